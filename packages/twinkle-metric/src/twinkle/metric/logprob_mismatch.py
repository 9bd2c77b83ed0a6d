"""``LogprobMismatchMetric``: how far the sampler's token log-probs are from the trainer's."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Metric
from twinkle.metric.arrays import rows, selected
from twinkle.registry import register


@register("metric")
class LogprobMismatchMetric(Metric):
    """Per-token ``|logp_trainer - logp_sampler|`` over the completions seen since ``reset``.

    RL losses treat the sampler's log-probs as the old policy's. When the
    inference engine differs numerically from the trainer (other kernels,
    precision, a stale weight sync), the importance ratio is off even on the
    first step; exporting this mismatch makes such a drift visible.
    ``calculate()`` returns ``logprob_mismatch/mean_abs``, ``.../max_abs`` and
    ``.../num_tokens`` (``{}`` before anything was accumulated).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sum_abs = 0.0
        self._max_abs = 0.0
        self._num_tokens = 0

    def accumulate(
        self,
        sampler_logps: Sequence[Sequence[float]],
        trainer_logps: Sequence[Sequence[float]],
        masks: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """Add one batch: per-sample log-probs of the same completion tokens, and optionally which tokens count.

        Sample ``i``'s three rows must have equal length: slice the trainer's
        full-sequence ``logps`` to the completion tokens the sampler scored.
        """
        if isinstance(sampler_logps, Sequence) and any(row is None for row in sampler_logps):
            missing = next(i for i, row in enumerate(sampler_logps) if row is None)
            raise InvalidInputError(
                f"sampler_logps[{missing}] is None: sample with SamplingParams(logprobs=True) to get log-probs"
            )
        sampler_rows, trainer_rows = rows(sampler_logps, "sampler_logps"), rows(trainer_logps, "trainer_logps")
        if len(sampler_rows) != len(trainer_rows):
            raise InvalidInputError(
                f"sampler_logps has {len(sampler_rows)} samples but trainer_logps has {len(trainer_rows)}"
            )
        for index, (sampled, trained) in enumerate(zip(sampler_rows, trainer_rows, strict=True)):
            if sampled.size != trained.size:
                raise InvalidInputError(
                    f"sampler_logps[{index}] has {sampled.size} tokens but trainer_logps[{index}] has {trained.size}"
                )
        differences = [np.abs(trained - sampled) for sampled, trained in zip(sampler_rows, trainer_rows, strict=True)]
        counted = selected(differences, masks, "sampler_logps")
        if counted.size:
            self._sum_abs += float(counted.sum())
            self._max_abs = max(self._max_abs, float(counted.max()))
            self._num_tokens += counted.size

    def calculate(self) -> dict[str, float]:
        if not self._num_tokens:
            return {}
        return {
            "logprob_mismatch/mean_abs": self._sum_abs / self._num_tokens,
            "logprob_mismatch/max_abs": self._max_abs,
            "logprob_mismatch/num_tokens": float(self._num_tokens),
        }
