"""Importance-weighted policy gradients without PPO's min: IS, CISPO and DRO (notation in :mod:`twinkle.loss.policy`).

These three are Tinker's ``importance_sampling``, ``cispo`` and ``dro``
(tinker-docs ``/tinker/losses``); with ``reduction='token_sum'`` they compute
exactly Tinker's ``loss:sum``.
"""

from __future__ import annotations

import torch

from twinkle.loss.policy import PolicyBatch, PolicyLoss, clip_bounds, non_negative
from twinkle.loss.reduction import Reducer, Reduction
from twinkle.registry import register


@register("loss", name="importance_sampling")
@register("loss")
class ImportanceSamplingLoss(PolicyLoss):
    """``reduce(−r·A)``: REINFORCE corrected for sampling from ``q`` (Tinker's ``importance_sampling``).

    Its gradient is ``−r·A·∇lp``; on-policy (no ``old_logps``) that is plain
    REINFORCE, ``−A·∇lp``. The default ``'token_sum'`` is Tinker's reduction.
    """

    def __init__(self, reduction: Reduction | Reducer = "token_sum") -> None:
        super().__init__(reduction)

    def token_losses(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return -torch.exp(batch.log_ratio_BT) * batch.advantages_BT, {}


@register("loss", name="cispo")
@register("loss")
class CISPOLoss(PolicyLoss):
    """CISPO (MiniMax-M1, 2025): ``reduce(−sg(clip(r, 1−ε, 1+ε_high))·A·lp)``.

    Clipping the importance weight instead of the update keeps every token's
    gradient (PPO's min drops clipped tokens entirely). The paper normalises by
    the batch's token count (``'token_mean'``, the default). The defaults
    ``epsilon=1.0, epsilon_high=3.0`` are Tinker's ``cispo`` thresholds
    ``(0.0, 4.0)``, i.e. only an upper bound; Tinker's ``cispo`` also uses
    ``reduction='token_sum'``. Reports where the weight was clipped:
    ``clip_low_fraction`` (``r < 1−ε``) and ``clip_high_fraction`` (``r > 1+ε_high``).
    """

    def __init__(
        self, epsilon: float = 1.0, epsilon_high: float | None = 3.0, reduction: Reduction | Reducer = "token_mean"
    ) -> None:
        super().__init__(reduction)
        self.clip_low, self.clip_high = clip_bounds(epsilon, epsilon_high)

    def token_losses(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        ratio_BT = torch.exp(batch.log_ratio_BT.detach())
        weights_BT = ratio_BT.clamp(self.clip_low, self.clip_high)
        metrics = {
            "clip_low_fraction": batch.mean((ratio_BT < self.clip_low).to(ratio_BT.dtype)),
            "clip_high_fraction": batch.mean((ratio_BT > self.clip_high).to(ratio_BT.dtype)),
        }
        return -weights_BT * batch.advantages_BT * batch.logps_BT, metrics


@register("loss", name="dro")
@register("loss")
class DROLoss(PolicyLoss):
    """DRO as Tinker defines ``dro``: ``reduce(−(lp·A − ½·beta·(lp − q)²))``.

    A policy-gradient term with a quadratic penalty on the log-ratio to the
    sampling policy instead of a clip, which makes it usable off-policy and
    offline (Richemond et al. 2024, "Offline Regularised Reinforcement Learning
    for LLM Alignment"; Kimi k1.5, 2025). The advantages are the caller's
    (Tinker's docs note DRO expects a soft advantage estimate). ``beta`` has no
    published default and must be given; ``'token_sum'`` is Tinker's reduction.
    """

    def __init__(self, beta: float, reduction: Reduction | Reducer = "token_sum") -> None:
        super().__init__(reduction)
        self.beta = non_negative(beta, "beta")

    def token_losses(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        log_ratio_BT = batch.log_ratio_BT
        return -(batch.logps_BT * batch.advantages_BT - 0.5 * self.beta * log_ratio_BT**2), {}
