"""Generalised advantage estimation (GAE) over ragged per-token sequences, for PPO with a value model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from twinkle.advantage.checks import finite_number, finite_vector, is_scalar, number_in, per_sample
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Advantage
from twinkle.registry import register


@register("advantage")
class GAEAdvantage(Advantage):
    """Per-token advantages and returns from rewards and value estimates.

    Over one sample's valid tokens ``t = 0..T-1`` (where its mask is 1)::

        delta_t = r_t + gamma * V_{t+1} - V_t        (V_T = 0: the sequence ends)
        A_t     = delta_t + gamma * lam * A_{t+1}    (A_T = 0)
        R_t     = A_t + V_t                          (the value model's target)

    Masked-out positions (prompt, padding) are not actions: their rewards and
    values are skipped — the recursion jumps over them — and their advantages
    and returns are 0. A sample's reward is a scalar, credited to its last valid
    token (an outcome reward), or one reward per token (e.g. with a per-token KL
    penalty folded in). With ``normalize``, advantages are whitened over every
    valid token of the batch, ``(A - mean) / sqrt(var + eps)`` with Bessel's
    correction, as veRL does; returns are computed before whitening.
    """

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, normalize: bool = True, eps: float = 1e-8) -> None:
        self.gamma = number_in(gamma, "gamma", 0.0, 1.0)
        self.lam = number_in(lam, "lam", 0.0, 1.0)
        self.normalize = bool(normalize)
        self.eps = number_in(eps, "eps", 0.0, math.inf, low_open=True)

    def __call__(
        self,
        rewards: Sequence[float | Sequence[float]],
        values: Sequence[Sequence[float]],
        masks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``(advantages, returns)``: two lists of float32 arrays shaped like ``values``."""
        values_list = per_sample(values, "values")
        rewards_list = per_sample(rewards, "rewards")
        masks_list = None if masks is None else per_sample(masks, "masks")
        for name, batch in (("rewards", rewards_list), ("masks", masks_list)):
            if batch is not None and len(batch) != len(values_list):
                raise InvalidInputError(f"{name} has {len(batch)} samples but values has {len(values_list)}")
        if not values_list:
            raise InvalidInputError("values is empty")
        advantages, returns, valid = [], [], []
        for i, sample_values in enumerate(values_list):
            values_T = finite_vector(sample_values, f"values[{i}]")
            mask_T = _mask(None if masks_list is None else masks_list[i], values_T.size, i)
            rewards_T = _token_rewards(rewards_list[i], mask_T, i)
            advantages_T = np.zeros_like(values_T)
            advantages_T[mask_T] = _gae(rewards_T[mask_T], values_T[mask_T], self.gamma, self.lam)
            advantages.append(advantages_T)
            returns.append(np.where(mask_T, advantages_T + values_T, 0.0).astype(np.float32))
            valid.append(mask_T)
        if self.normalize:
            advantages = _whiten(advantages, valid, self.eps)
        return [a.astype(np.float32) for a in advantages], returns


def _gae(rewards_T: np.ndarray, values_T: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """The backward GAE recursion over one sample's valid tokens (on Python floats: faster than numpy scalars)."""
    rewards, values = rewards_T.tolist(), values_T.tolist()
    advantages = [0.0] * len(values)
    next_value = next_advantage = 0.0
    for t in reversed(range(len(values))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t] = next_advantage
        next_value = values[t]
    return np.asarray(advantages)


def _whiten(advantages: list[np.ndarray], valid: list[np.ndarray], eps: float) -> list[np.ndarray]:
    selected = np.concatenate([a[m] for a, m in zip(advantages, valid, strict=True)])
    mean = selected.mean()
    var = selected.var(ddof=1) if selected.size > 1 else 0.0
    scale = 1.0 / np.sqrt(var + eps)
    return [np.where(m, (a - mean) * scale, 0.0) for a, m in zip(advantages, valid, strict=True)]


def _mask(mask: Any, length: int, index: int) -> np.ndarray:
    if length == 0:
        raise InvalidInputError(f"values[{index}] is empty: every sample needs at least one token")
    if mask is None:
        return np.ones(length, dtype=bool)
    mask_T = finite_vector(mask, f"masks[{index}]")
    if mask_T.size != length:
        raise InvalidInputError(f"masks[{index}] has {mask_T.size} entries but values[{index}] has {length}")
    if not np.isin(mask_T, (0.0, 1.0)).all():
        raise InvalidInputError(f"masks[{index}] must hold only 0 and 1")
    if not mask_T.any():
        raise InvalidInputError(f"masks[{index}] selects no token, so sample {index} has no action to credit")
    return mask_T.astype(bool)


def _token_rewards(reward: Any, mask_T: np.ndarray, index: int) -> np.ndarray:
    """A scalar reward placed on the last valid token, or a per-token reward row checked for length."""
    if is_scalar(reward):
        rewards_T = np.zeros(mask_T.size)
        rewards_T[np.flatnonzero(mask_T)[-1]] = finite_number(reward, f"rewards[{index}]")
        return rewards_T
    rewards_T = finite_vector(reward, f"rewards[{index}]")
    if rewards_T.size != mask_T.size:
        raise InvalidInputError(f"rewards[{index}] has {rewards_T.size} entries but values[{index}] has {mask_T.size}")
    return rewards_T
