"""Grouping a flat batch of rewards by prompt, and back.

``num_generations`` completions were sampled per prompt; a batch of
``N = P * G`` rewards holds them in one of two orders:

* ``'contiguous'`` (prompt-major): sample ``i`` belongs to prompt ``i // G``
  (``[p0, p0, p1, p1]``). A sampler's response is always in this order, for
  ``sample(prompts, num_samples=G)`` and for ``sample(prompts * G)`` alike
  (identical prompts are one group).
* ``'interleaved'``: sample ``i`` belongs to prompt ``i % P``
  (``[p0, p1, p0, p1]``), for batches laid out by hand that way, e.g. rewards
  of ``G`` separate sampling rounds over the same prompts, concatenated.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from twinkle.advantage.checks import choice, finite_vector, positive_int
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Advantage

GroupLayout = Literal["contiguous", "interleaved"]
GROUP_LAYOUTS: tuple[GroupLayout, ...] = ("contiguous", "interleaved")


def to_groups(rewards_N: np.ndarray, num_generations: int, group_layout: GroupLayout) -> np.ndarray:
    """``[N]`` rewards to ``[P, G]``: row ``p`` holds prompt ``p``'s completions."""
    if rewards_N.size % num_generations:
        raise InvalidInputError(
            f"{rewards_N.size} rewards cannot be split into groups of num_generations={num_generations}"
        )
    if group_layout == "contiguous":
        return rewards_N.reshape(-1, num_generations)
    rewards_PG: np.ndarray = rewards_N.reshape(num_generations, -1).T
    return rewards_PG


def from_groups(values_PG: np.ndarray, group_layout: GroupLayout) -> np.ndarray:
    """The inverse of :func:`to_groups`: ``[P, G]`` back to the batch order, as float32."""
    values_N = values_PG.reshape(-1) if group_layout == "contiguous" else values_PG.T.reshape(-1)
    return values_N.astype(np.float32)


def sample_std(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Standard deviation with Bessel's correction (``ddof=1``); 0 for a single value."""
    count = values.size if axis is None else values.shape[axis]
    if count < 2:
        return np.zeros_like(values.mean(axis=axis, keepdims=True))
    std: np.ndarray = values.std(axis=axis, ddof=1, keepdims=True)
    return std


class GroupAdvantage(Advantage):
    """An advantage computed from the rewards of completions of the same prompt."""

    def __init__(self, group_layout: GroupLayout = "contiguous") -> None:
        self.group_layout = choice(group_layout, "group_layout", GROUP_LAYOUTS)

    def _grouped(
        self, rewards: Any, num_generations: int, group_layout: GroupLayout | None
    ) -> tuple[np.ndarray, GroupLayout]:
        """Checked ``[P, G]`` rewards and the layout to restore (the call's or the instance's)."""
        layout = choice(group_layout or self.group_layout, "group_layout", GROUP_LAYOUTS)
        rewards_N = finite_vector(rewards, "rewards")
        if rewards_N.size == 0:
            raise InvalidInputError("rewards is empty")
        return to_groups(rewards_N, positive_int(num_generations, "num_generations"), layout), layout
