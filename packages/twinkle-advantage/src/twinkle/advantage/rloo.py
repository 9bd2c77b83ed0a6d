"""REINFORCE leave-one-out (RLOO) advantages."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from twinkle.advantage.checks import positive_int
from twinkle.advantage.grouping import GroupAdvantage, GroupLayout, from_groups
from twinkle.registry import register


@register("advantage")
class RLOOAdvantage(GroupAdvantage):
    """``A_i = r_i - mean_{j != i} r_j``: each completion's baseline is the mean of its group's *other* rewards.

    The baseline does not depend on ``r_i``, so the policy gradient stays
    unbiased (Kool et al. 2019; Ahmadian et al. 2024). Equivalently
    ``A_i = G / (G - 1) * (r_i - mean_group(r))``; needs ``num_generations >= 2``.
    Returns a float32 array in the batch's order.
    """

    def __call__(
        self,
        rewards: Sequence[float] | np.ndarray,
        num_generations: int,
        group_layout: GroupLayout | None = None,
    ) -> np.ndarray:
        positive_int(num_generations, "num_generations", minimum=2)
        rewards_PG, layout = self._grouped(rewards, num_generations, group_layout)
        others_mean_PG = (rewards_PG.sum(axis=1, keepdims=True) - rewards_PG) / (num_generations - 1)
        return from_groups(rewards_PG - others_mean_PG, layout)
