"""``CompletionRewardMetric``: reward and completion-length statistics of RL rollouts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Metric
from twinkle.metric.arrays import finite_vector, same_length
from twinkle.registry import register


@register("metric")
class CompletionRewardMetric(Metric):
    """Mean and std of each named reward, and completion lengths, over the completions seen since ``reset``.

    ``calculate()`` returns ``reward/<name>/mean`` and ``reward/<name>/std`` for
    every reward name, ``completion_length/mean|max|min`` and ``num_completions``
    (``{}`` before anything was accumulated). Stds are population stds
    (``ddof=0``): they describe the rewards observed, not an estimate.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._rewards: dict[str, list[np.ndarray]] = {}
        self._lengths: list[np.ndarray] = []
        self._num_completions = 0

    def accumulate(
        self,
        completion_lengths: Sequence[int] | None = None,
        rewards: Mapping[str, Sequence[float]] | Sequence[float] | None = None,
    ) -> None:
        """Add one batch: token counts per completion and/or rewards (``{name: values}``; a plain list is 'total').

        Every reward list, and ``completion_lengths``, must have one entry per completion of the batch;
        an empty batch changes nothing.
        """
        if completion_lengths is None and rewards is None:
            raise InvalidInputError("CompletionRewardMetric.accumulate needs completion_lengths and/or rewards")
        named = _named_rewards(rewards)
        batch: dict[str, np.ndarray] = {f"rewards[{name!r}]": values for name, values in named.items()}
        if completion_lengths is not None:
            lengths = finite_vector(completion_lengths, "completion_lengths")
            if (lengths < 0).any():
                raise InvalidInputError(f"completion_lengths must be >= 0, got {lengths.min()}")
            batch["completion_lengths"] = lengths
        (first_name, first), *others = batch.items()
        for name, values in others:
            same_length(first, values, first_name, name)
        if first.size == 0:
            return
        for name, values in named.items():
            self._rewards.setdefault(name, []).append(values)
        if completion_lengths is not None:
            self._lengths.append(batch["completion_lengths"])
        self._num_completions += first.size

    def calculate(self) -> dict[str, float]:
        result: dict[str, float] = {}
        for name, batches in sorted(self._rewards.items()):
            values = np.concatenate(batches)
            result[f"reward/{name}/mean"] = float(values.mean())
            result[f"reward/{name}/std"] = float(values.std())
        if self._lengths:
            lengths = np.concatenate(self._lengths)
            result["completion_length/mean"] = float(lengths.mean())
            result["completion_length/max"] = float(lengths.max())
            result["completion_length/min"] = float(lengths.min())
        if self._num_completions:
            result["num_completions"] = float(self._num_completions)
        return result


def _named_rewards(rewards: Any) -> dict[str, np.ndarray]:
    if rewards is None:
        return {}
    if not isinstance(rewards, Mapping):
        return {"total": finite_vector(rewards, "rewards")}
    if not rewards:
        raise InvalidInputError("rewards must name at least one reward, got {}")
    return {str(name): finite_vector(values, f"rewards[{name!r}]") for name, values in rewards.items()}
