"""GSPO: the importance ratio and its clip taken per sequence (notation in :mod:`twinkle.loss.policy`)."""

from __future__ import annotations

import torch

from twinkle.loss.policy import PolicyBatch, PolicyLoss, clip_bounds, non_negative
from twinkle.loss.ppo import clipped_surrogate
from twinkle.loss.reduction import Reducer, Reduction, per_sequence_sums, sequence_ids
from twinkle.registry import register


@register("loss", name="gspo")
@register("loss")
class GSPOLoss(PolicyLoss):
    """GSPO (Zheng et al. 2025), in its GSPO-token form: ``reduce(−min(s_t·A, clip(s_t, 1−ε, 1+ε_high)·A))``.

    ``s_i = exp(mean_t(lp − q))`` over sequence ``i``'s trained tokens is the
    length-normalised sequence likelihood ratio, and
    ``s_t = sg(s_i) · exp(lp_t − sg(lp_t))`` equals ``s_i`` in value with the
    gradient ``s_i · ∇lp_t`` (paper §4.3). With one advantage per sequence and
    the default ``'sequence_mean'`` reduction this is exactly the paper's
    sequence-level objective ``mean_i −min(s_i·A_i, clip(s_i)·A_i)``, value and
    gradient; per-token advantages are allowed too. The defaults
    ``epsilon=3e-4, epsilon_high=4e-4`` are the paper's (sequence ratios stay
    close to 1). Tinker's ``gspo`` is the same with ``reduction='token_sum'``
    and clip thresholds mapped as in :class:`~twinkle.loss.ppo.PPOLoss`.
    ``beta > 0`` adds the ``k3`` KL penalty of :class:`~twinkle.loss.ppo.GRPOLoss`.
    """

    def __init__(
        self,
        epsilon: float = 3e-4,
        epsilon_high: float | None = 4e-4,
        beta: float = 0.0,
        reduction: Reduction | Reducer = "sequence_mean",
    ) -> None:
        super().__init__(reduction)
        self.clip_low, self.clip_high = clip_bounds(epsilon, epsilon_high)
        self.kl_coef = non_negative(beta, "beta")

    def token_losses(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask_BT = batch.mask_BT.to(batch.logps_BT.dtype)
        sums_S = per_sequence_sums(batch.log_ratio_BT.detach() * mask_BT, batch.inputs)
        counts_S = per_sequence_sums(mask_BT, batch.inputs).clamp(min=1)
        ids_BT = sequence_ids(batch.inputs, mask_BT.shape).to(mask_BT.device)
        logps_BT = batch.logps_BT
        ratio_BT = torch.exp((sums_S / counts_S)[ids_BT] + logps_BT - logps_BT.detach())
        return clipped_surrogate(ratio_BT, batch, self.clip_low, self.clip_high)
