"""Synthetic RL batches in every layout the collator produces, and reference reductions.

Each sample is a prompt (untrained) followed by a completion (trained), with
the completion's log-probs as a float64 leaf tensor, so a test can compare a
loss and its gradients against a reference computed per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from twinkle.data_format import IGNORE_INDEX, ModelOutput

LAYOUTS = ("right", "left", "packed")


@dataclass
class Sample:
    prompt_len: int
    logps: torch.Tensor  # [completion] float64 leaf: the policy's log-probs of the completion
    old: list[float]  # the sampler's log-probs of the completion
    ref: list[float]  # a reference model's log-probs of the completion
    advantage: float
    token_advantages: list[float]

    @property
    def length(self) -> int:
        return self.prompt_len + self.logps.numel()

    def full(self, values: Sequence[float]) -> list[float]:
        """Completion values padded to the sample's full length (0 on the prompt)."""
        return [0.0] * self.prompt_len + list(values)


class RLData:
    """Samples with random log-probs; :meth:`batch` collates any subset in any layout."""

    def __init__(self, seed: int = 0, completions: Sequence[int] = (4, 6, 1, 5), prompts: Sequence[int] = (3, 2, 4, 2)):
        g = torch.Generator().manual_seed(seed)

        def uniform(n: int, low: float, high: float) -> torch.Tensor:
            return low + (high - low) * torch.rand(n, generator=g, dtype=torch.float64)

        self.samples = []
        for completion, prompt in zip(completions, prompts, strict=True):
            logps = uniform(completion, -3.0, -0.05)
            self.samples.append(
                Sample(
                    prompt_len=prompt,
                    logps=logps.clone().requires_grad_(),
                    old=(logps + uniform(completion, -0.6, 0.6)).clamp(max=0).tolist(),
                    ref=(logps + uniform(completion, -0.8, 0.8)).clamp(max=0).tolist(),
                    advantage=float(uniform(1, -1.5, 1.5)),
                    token_advantages=uniform(completion, -1.5, 1.5).tolist(),
                )
            )

    @property
    def leaves(self) -> list[torch.Tensor]:
        return [s.logps for s in self.samples]

    def batch(self, layout: str = "right", indices: Sequence[int] | None = None) -> tuple[dict, ModelOutput]:
        """The collated ``inputs`` and a ``ModelOutput`` whose ``logps`` are built (differentiably) from the leaves."""
        samples = [self.samples[i] for i in (range(len(self.samples)) if indices is None else indices)]
        rows = [torch.cat([torch.zeros(s.prompt_len, dtype=torch.float64), s.logps]) for s in samples]
        masks = [torch.tensor([0.0] * s.prompt_len + [1.0] * s.logps.numel()) for s in samples]
        lengths = [s.length for s in samples]
        if layout == "packed":
            logps_BT, mask_BT = torch.cat(rows).unsqueeze(0), torch.cat(masks).unsqueeze(0)
            starts = [sum(lengths[:i]) for i in range(len(lengths))]
        else:
            width = max(lengths)

            def pad(row: torch.Tensor) -> torch.Tensor:
                padding = torch.zeros(width - row.numel(), dtype=row.dtype)
                return torch.cat([row, padding] if layout == "right" else [padding, row])

            logps_BT, mask_BT = torch.stack([pad(r) for r in rows]), torch.stack([pad(m) for m in masks])
            starts = [i * width + (0 if layout == "right" else width - n) for i, n in enumerate(lengths)]
        labels_BT = torch.where(mask_BT > 0, 7, IGNORE_INDEX)
        inputs = {
            "labels": labels_BT,
            "loss_mask": mask_BT,
            "seq_lens": torch.tensor(lengths),
            "seq_starts": torch.tensor(starts),
        }
        return inputs, ModelOutput(logps=logps_BT)


@pytest.fixture
def data() -> RLData:
    return RLData()


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def reference_reduce() -> Callable[[list[torch.Tensor], str], torch.Tensor]:
    """Reduce per-sample token losses as the reductions are documented, with explicit sums."""

    def reduce(per_sample: list[torch.Tensor], reduction: str) -> torch.Tensor:
        if reduction == "token_sum":
            return sum(t.sum() for t in per_sample)
        if reduction == "token_mean":
            return sum(t.sum() for t in per_sample) / sum(t.numel() for t in per_sample)
        assert reduction == "sequence_mean"
        return sum(t.mean() for t in per_sample) / len(per_sample)

    return reduce


@pytest.fixture
def pair_data() -> RLData:
    """Three preference pairs: samples 0-2 are the chosen responses, 3-5 the rejected ones, in pair order."""
    return RLData(seed=1, completions=(4, 6, 1, 5, 3, 2), prompts=(3, 2, 4, 2, 1, 3))
