"""How far a sampler's log-probs of its completions are from a trainer's ``forward_only`` ones."""

from __future__ import annotations

from typing import Any


def max_logprob_gap(sampler_logps: list[list[float]], output: Any, inputs: list[dict[str, Any]]) -> float:
    """The largest difference between the sampler's and the trainer's log-prob of a completion token."""
    gaps = []
    for sampled, trainer, feature in zip(sampler_logps, output.logps, inputs, strict=True):
        completion = [lp for lp, mask in zip(trainer.tolist(), feature["loss_mask"], strict=True) if mask]
        gaps += [abs(a - b) for a, b in zip(sampled, completion, strict=True)]
    return max(gaps)
