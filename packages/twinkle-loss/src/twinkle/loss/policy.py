"""What the policy-gradient losses share: their inputs, the optional KL penalty, and their statistics.

Every policy loss is called as ``loss(inputs, outputs, advantages=..., old_logps=..., ref_logps=...)``:

- ``advantages`` (required): per sample, one scalar or per-token values (see :mod:`twinkle.loss.alignment`);
- ``old_logps``: the sampling policy's log-probs of the trained tokens. Omitted, they are ``sg(lp)`` — the
  on-policy case, where every ratio is 1 and its gradient is ``∇lp``;
- ``ref_logps``: a reference policy's log-probs, only for losses with a KL coefficient ``beta > 0``.

Notation in the loss docstrings: ``lp`` = ``outputs.logps``, ``q`` = ``old_logps``, ``r = exp(lp − q)``,
``A`` = advantages, ``sg`` = stop-gradient, ``ℓ_t`` the per-token loss, and ``reduce`` the loss's reduction
(:class:`~twinkle.loss.reduction.TokenReduction` by name, or any
:class:`~twinkle.loss.reduction.Reducer`). Tokens that are not trained get ``q = ref = sg(lp)``, so a
sampler value there can never overflow a ratio.

Every policy loss reports, over this call's trained tokens: ``ratio`` (mean ``r``), ``approx_kl``
(mean ``(r − 1) − log r``, Schulman's k3 estimate of KL(π_old ‖ π_θ)), ``abs_log_ratio_max`` (the
largest ``|lp − q|``: on the first mini-batch after a weight sync, how far the sampler's log-probs are
from the trainer's — 0 up to float rounding when both compute the same policy), ``kl`` (mean k3
estimate of KL(π_θ ‖ π_ref), when ``beta > 0``) and its own figures (clip fractions).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.interfaces import Loss
from twinkle.loss.alignment import model_logps, per_token
from twinkle.loss.reduction import Reducer, Reduction, as_reducer


def clip_bounds(epsilon: float, epsilon_high: float | None) -> tuple[float, float]:
    """The ratio interval ``(1 − ε_low, 1 + ε_high)``; ``epsilon_high`` defaults to ``epsilon``.

    Tinker's ``clip_low_threshold``/``clip_high_threshold`` are these bounds:
    ``epsilon = 1 − clip_low_threshold``, ``epsilon_high = clip_high_threshold − 1``.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if not (math.isfinite(epsilon) and 0 <= epsilon <= 1):
        raise ConfigurationError(f"epsilon must be in [0, 1] (the ratio's lower bound is 1 - epsilon), got {epsilon}")
    if not (math.isfinite(epsilon_high) and epsilon_high >= 0):
        raise ConfigurationError(f"epsilon_high must be a finite number >= 0, got {epsilon_high}")
    return 1.0 - epsilon, 1.0 + epsilon_high


def non_negative(value: float, name: str) -> float:
    """``value`` checked to be a finite number ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigurationError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def k3(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    """``exp(x) − x − 1`` for ``x = log(p/q)`` under samples of ``q``: an unbiased, non-negative KL(q ‖ p) estimate."""
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1


@dataclass
class PolicyBatch:
    """One call's aligned tensors, all ``[B, T]`` in the dtype and device of ``outputs.logps``."""

    inputs: Mapping[str, Any]
    logps_BT: torch.Tensor
    old_logps_BT: torch.Tensor
    advantages_BT: torch.Tensor
    mask_BT: torch.Tensor  # bool: the tokens with a positive weight

    @property
    def log_ratio_BT(self) -> torch.Tensor:
        """``lp − q`` (0 on untrained tokens)."""
        return self.logps_BT - self.old_logps_BT

    def mean(self, values_BT: torch.Tensor) -> float:
        """Mean of ``values_BT`` over the trained tokens (0.0 when there are none)."""
        count = int(self.mask_BT.sum())
        return float(values_BT.detach()[self.mask_BT].sum()) / count if count else 0.0

    def max(self, values_BT: torch.Tensor) -> float:
        """Largest value of ``values_BT`` over the trained tokens (0.0 when there are none)."""
        selected = values_BT.detach()[self.mask_BT]
        return float(selected.max()) if selected.numel() else 0.0


class PolicyLoss(Loss):
    """Base of the policy-gradient losses: ``reduce(ℓ_t + beta · k3(ref − lp))`` with ``ℓ_t`` from :meth:`token_losses`.

    Subclasses set ``kl_coef`` (their ``beta``) to offer the KL penalty; ``None`` means they have none.
    """

    required_inputs = ("advantages",)

    kl_coef: float | None = None

    def __init__(self, reduction: Reduction | Reducer) -> None:
        self.reduction = as_reducer(reduction)

    def normalizer(self, inputs: Mapping[str, Any]) -> float:
        """The whole batch's denominator under this loss's reduction."""
        return self.reduction.normalizer(inputs)

    @abstractmethod
    def token_losses(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Per-token losses ``ℓ_t`` ``[B, T]`` and this loss's own statistics."""

    def __call__(
        self,
        inputs: Mapping[str, Any],
        outputs: ModelOutput,
        normalizer: float | None = None,
        advantages: Any = None,
        old_logps: Any = None,
        ref_logps: Any = None,
        **unknown: Any,
    ) -> LossOutput:
        name = type(self).__name__
        if unknown:
            raise InvalidInputError(
                f"{name} got unknown inputs {sorted(unknown)}; it takes advantages, old_logps and ref_logps"
            )
        if advantages is None:
            raise InvalidInputError(f"{name} needs advantages=[...]: one per sample, or per-token lists")
        batch = self._batch(inputs, outputs, advantages, old_logps)
        values_BT, metrics = self.token_losses(batch)
        if self.kl_coef:
            if ref_logps is None:
                raise InvalidInputError(
                    f"{name} has beta={self.kl_coef} > 0 and needs ref_logps: the reference policy's log-probs "
                    "of each sample's trained tokens"
                )
            kl_BT = k3(_aligned_logps(ref_logps, "ref_logps", inputs, batch.logps_BT, batch.mask_BT) - batch.logps_BT)
            values_BT = values_BT + self.kl_coef * kl_BT
            metrics["kl"] = batch.mean(kl_BT)
        elif ref_logps is not None:
            reason = "has no KL term" if self.kl_coef is None else "has beta=0; set beta > 0 for a KL penalty"
            raise InvalidInputError(f"{name} got ref_logps but {reason}")
        log_ratio_BT = batch.log_ratio_BT.detach()
        metrics["ratio"] = batch.mean(torch.exp(log_ratio_BT))
        metrics["approx_kl"] = batch.mean(k3(log_ratio_BT))
        metrics["abs_log_ratio_max"] = batch.max(log_ratio_BT.abs())  # a maximum: models combine it by max
        loss, num_tokens = self.reduction.reduce(values_BT, inputs, normalizer)
        return LossOutput(loss=loss, num_tokens=num_tokens, metrics=metrics)

    def _batch(self, inputs: Mapping[str, Any], outputs: ModelOutput, advantages: Any, old_logps: Any) -> PolicyBatch:
        logps_BT, weights_BT = model_logps(inputs, outputs, type(self).__name__)
        mask_BT = weights_BT > 0
        return PolicyBatch(
            inputs=inputs,
            logps_BT=logps_BT,
            old_logps_BT=(
                logps_BT.detach()
                if old_logps is None
                else _aligned_logps(old_logps, "old_logps", inputs, logps_BT, mask_BT)
            ),
            advantages_BT=per_token(advantages, inputs, "advantages", dtype=logps_BT.dtype, device=logps_BT.device),
            mask_BT=mask_BT,
        )


def _aligned_logps(
    values: Any, name: str, inputs: Mapping[str, Any], logps_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """Given log-probs on the trained tokens, ``sg(lp)`` on the others."""
    values_BT = per_token(values, inputs, name, dtype=logps_BT.dtype, device=logps_BT.device)
    return torch.where(mask_BT, values_BT, logps_BT.detach())
