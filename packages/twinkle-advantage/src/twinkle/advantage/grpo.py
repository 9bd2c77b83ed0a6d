"""Group-relative advantages: GRPO (and Dr. GRPO with ``scale='none'``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from twinkle.advantage.checks import choice, number_in
from twinkle.advantage.grouping import GroupAdvantage, GroupLayout, from_groups, sample_std
from twinkle.registry import register

Scale = Literal["group", "batch", "none"]
SCALES: tuple[Scale, ...] = ("group", "batch", "none")


@register("advantage")
class GRPOAdvantage(GroupAdvantage):
    """``A_i = (r_i - mean_group(r)) / (std + eps)``, one advantage per completion.

    ``scale`` picks the divisor: ``'group'`` the std of the completion's own
    group (GRPO), ``'batch'`` the std of all rewards in the batch (more stable
    when groups are small), ``'none'`` no division (Dr. GRPO: dividing by a
    group's std up-weights prompts that are nearly always solved or failed).
    Stds use Bessel's correction (``ddof=1``), as TRL and veRL do, so numbers
    compare with those frameworks. A group whose rewards are all equal gets
    advantage 0 (``eps`` avoids 0/0), and so does every group of one.

    Options given at construction are defaults; the same keywords on a call override them.
    Returns a float32 array in the batch's order (``.tolist()`` for plain floats).
    """

    def __init__(self, scale: Scale = "group", eps: float = 1e-6, group_layout: GroupLayout = "contiguous") -> None:
        super().__init__(group_layout)
        self.scale = choice(scale, "scale", SCALES)
        self.eps = number_in(eps, "eps", 0.0, math.inf, low_open=True)

    def __call__(
        self,
        rewards: Sequence[float] | np.ndarray,
        num_generations: int,
        scale: Scale | None = None,
        eps: float | None = None,
        group_layout: GroupLayout | None = None,
    ) -> np.ndarray:
        scale = choice(scale or self.scale, "scale", SCALES)
        eps = self.eps if eps is None else number_in(eps, "eps", 0.0, math.inf, low_open=True)
        rewards_PG, layout = self._grouped(rewards, num_generations, group_layout)
        advantages_PG = rewards_PG - rewards_PG.mean(axis=1, keepdims=True)
        if scale == "group":
            advantages_PG = advantages_PG / (sample_std(rewards_PG, axis=1) + eps)
        elif scale == "batch":
            advantages_PG = advantages_PG / (sample_std(rewards_PG) + eps)
        return from_groups(advantages_PG, layout)
