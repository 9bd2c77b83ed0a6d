"""``PolicyMetric``: means of policy-optimisation statistics (clip fractions, KL, entropy, ratios)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Metric
from twinkle.metric.arrays import finite_number, is_scalar, selected
from twinkle.registry import register


@register("metric")
class PolicyMetric(Metric):
    """Running means of any named statistics, reported as ``policy/<name>``.

    Typical names: ``clip_fraction`` (or ``clip_low_fraction``/``clip_high_fraction``),
    ``approx_kl``, ``entropy``, ``ratio``. Each value is

    * a scalar (an already-reduced figure): one observation;
    * a flat list of numbers, or per-sample lists of per-token numbers: one
      observation per entry, restricted to the entries where ``masks`` (same
      shape, 0/1) is 1 — pass the completion's loss mask so prompt and padding
      tokens do not dilute a token mean.

    The mean is over all observations since ``reset``, so per-token values give
    a token-weighted mean across batches. Report one name in one form: mixing
    scalars and token lists weighs a scalar like a single token.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def accumulate(self, masks: Sequence[Sequence[int]] | None = None, **values: Any) -> None:
        """Add observations, e.g. ``accumulate(clip_fraction=0.1, entropy=entropy_rows, masks=loss_mask_rows)``."""
        if not values:
            raise InvalidInputError("PolicyMetric.accumulate needs at least one named value, e.g. approx_kl=0.01")
        batch = {name: _observations(value, masks, name) for name, value in values.items()}
        for name, observed in batch.items():
            self._sums[name] = self._sums.get(name, 0.0) + float(observed.sum())
            self._counts[name] = self._counts.get(name, 0) + observed.size

    def calculate(self) -> dict[str, float]:
        return {f"policy/{name}": self._sums[name] / count for name, count in sorted(self._counts.items()) if count}


def _observations(value: Any, masks: Any, name: str) -> np.ndarray:
    if is_scalar(value):
        return np.array([finite_number(value, name)])
    return selected(value, masks, name)
