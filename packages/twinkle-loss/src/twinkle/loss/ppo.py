"""Clipped-surrogate policy losses: GRPO, PPO and Dr. GRPO (notation in :mod:`twinkle.loss.policy`)."""

from __future__ import annotations

import torch

from twinkle.loss.policy import PolicyBatch, PolicyLoss, clip_bounds, non_negative
from twinkle.loss.reduction import ConstantLengthReduction, Reducer, Reduction
from twinkle.registry import register


def clipped_surrogate(
    ratio_BT: torch.Tensor, batch: PolicyBatch, low: float, high: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """``ℓ_t = −min(r·A, clip(r, low, high)·A)`` and the fractions of tokens where the clip binds.

    A clip binds (and zeroes the token's gradient) where ``r < low`` with
    ``A < 0`` (``clip_low_fraction``) or ``r > high`` with ``A > 0`` (``clip_high_fraction``).
    """
    advantages_BT = batch.advantages_BT
    losses_BT = -torch.min(ratio_BT * advantages_BT, ratio_BT.clamp(low, high) * advantages_BT)
    ratio_BT = ratio_BT.detach()
    metrics = {
        "clip_low_fraction": batch.mean(((ratio_BT < low) & (advantages_BT < 0)).to(ratio_BT.dtype)),
        "clip_high_fraction": batch.mean(((ratio_BT > high) & (advantages_BT > 0)).to(ratio_BT.dtype)),
    }
    return losses_BT, metrics


@register("loss", name="grpo")
@register("loss")
class GRPOLoss(PolicyLoss):
    """GRPO: ``reduce(−min(r·A, clip(r, 1−ε, 1+ε_high)·A) + beta · k3(ref − lp))``.

    ``r = exp(lp − q)`` per token; ``k3(x) = eˣ − x − 1`` is the KL estimator of
    DeepSeekMath (Shao et al. 2024, eq. 4), added only when ``beta > 0`` (then
    ``ref_logps`` are required). ``epsilon_high`` (DAPO's clip-higher) defaults to
    ``epsilon``. ``reduction`` picks the aggregation: ``'sequence_mean'`` is the
    GRPO paper's (each sequence's token mean, averaged), ``'token_mean'``
    (default) weighs every token equally (DAPO, Yu et al. 2025), ``'token_sum'``
    is Tinker's; any :class:`~twinkle.loss.reduction.Reducer` works too.
    Advantages are usually one scalar per completion (group-normalised rewards).
    """

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        reduction: Reduction | Reducer = "token_mean",
    ) -> None:
        super().__init__(reduction)
        self.clip_low, self.clip_high = clip_bounds(epsilon, epsilon_high)
        self.kl_coef = non_negative(beta, "beta")

    def token_losses(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return clipped_surrogate(torch.exp(batch.log_ratio_BT), batch, self.clip_low, self.clip_high)


@register("loss", name="ppo")
@register("loss")
class PPOLoss(GRPOLoss):
    """PPO-clip (Schulman et al. 2017): the same objective as :class:`GRPOLoss`, named for per-token advantages.

    Use it with token-level advantages (e.g. GAE) given as per-token lists.
    Tinker's ``ppo`` is ``PPOLoss(epsilon=1 − clip_low_threshold,
    epsilon_high=clip_high_threshold − 1, reduction='token_sum')``:
    ``−Σ min(r·A, clip(r, lo, hi)·A)``.
    """


@register("loss", name="dr_grpo")
@register("loss")
class DRGRPOLoss(GRPOLoss):
    """Dr. GRPO: ``Σ_i Σ_t ℓ_it / (N · max_length)`` with ``ℓ`` the GRPO token loss (clip, optional KL).

    Liu et al. 2025 ("Understanding R1-Zero-Like Training: A Critical
    Perspective") remove GRPO's two biases: the ``1/|o_i|`` length normalisation
    (here: every sequence's token sum is divided by the same constant, the
    generation budget ``max_length``, as in the authors' code and TRL's
    ``dr_grpo``; ``N`` counts the batch's sequences) and the division of
    advantages by the group's reward std — compute advantages without it, e.g.
    ``GRPOAdvantage(scale='none')``.
    """

    def __init__(
        self, max_length: int, epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0
    ) -> None:
        super().__init__(epsilon, epsilon_high, beta, reduction=ConstantLengthReduction(max_length))
