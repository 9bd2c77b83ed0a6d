"""REINFORCE++ advantages with a group baseline."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from twinkle.advantage.checks import number_in
from twinkle.advantage.grouping import GroupAdvantage, GroupLayout, from_groups
from twinkle.registry import register


@register("advantage")
class ReinforcePlusPlusAdvantage(GroupAdvantage):
    """``A_i = c_i / (std_batch(c) + eps)`` with ``c_i = r_i - mean_group(r)``.

    REINFORCE++ (Hu et al. 2025, OpenRLHF's ``reinforce_baseline``): subtract
    the prompt's mean reward, then normalise over the *whole batch* rather than
    per group, which avoids GRPO's per-prompt std bias. The centred rewards have
    batch mean 0, so normalising is a division by their std, taken over the
    batch without Bessel's correction as OpenRLHF's whitening does. Returns a
    float32 array in the batch's order.
    """

    def __init__(self, eps: float = 1e-6, group_layout: GroupLayout = "contiguous") -> None:
        super().__init__(group_layout)
        self.eps = number_in(eps, "eps", 0.0, math.inf, low_open=True)

    def __call__(
        self,
        rewards: Sequence[float] | np.ndarray,
        num_generations: int,
        group_layout: GroupLayout | None = None,
    ) -> np.ndarray:
        rewards_PG, layout = self._grouped(rewards, num_generations, group_layout)
        centered_PG = rewards_PG - rewards_PG.mean(axis=1, keepdims=True)
        return from_groups(centered_PG / (centered_PG.std() + self.eps), layout)
