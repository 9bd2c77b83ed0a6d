"""How per-token loss values become one scalar, identically for padded and packed batches.

A batch may be split into micro-batches; to get the gradient of the whole
batch, every micro-batch divides by the *whole batch's* normaliser (tokens or
sequences), which :meth:`TokenReduction.normalizer` computes up front.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from twinkle.errors import ConfigurationError, InvalidInputError

Reduction = Literal["token_mean", "token_sum", "sequence_mean"]
REDUCTIONS: tuple[str, ...] = ("token_mean", "token_sum", "sequence_mean")


def token_weights(inputs: Mapping[str, Any]) -> torch.Tensor:
    """Per-token weights ``[B, T]``: ``loss_weights`` when given (float), else ``loss_mask``."""
    weights = inputs.get("loss_weights")
    if weights is None:
        weights = inputs.get("loss_mask")
    if weights is None:
        raise InvalidInputError(
            "the batch has neither 'loss_mask' nor 'loss_weights'; nothing says which tokens to train"
        )
    return weights.float()


def sequence_ids(inputs: Mapping[str, Any], shape: torch.Size) -> torch.Tensor:
    """Index of the sequence each token belongs to, ``[B, T]`` (packed rows hold several)."""
    seq_lens = inputs.get("seq_lens")
    batch, length = shape
    if seq_lens is not None and batch == 1 and len(seq_lens) > 1:
        lens = torch.as_tensor(seq_lens, dtype=torch.long)
        if int(lens.sum()) != length:
            raise InvalidInputError(f"seq_lens sum to {int(lens.sum())} but the packed row has {length} tokens")
        return torch.repeat_interleave(torch.arange(len(lens)), lens).unsqueeze(0)
    return torch.arange(batch).unsqueeze(1).expand(batch, length)


def per_sequence_sums(values_BT: torch.Tensor, inputs: Mapping[str, Any]) -> torch.Tensor:
    """Sum of ``values_BT`` over each sequence's tokens, ``[S]``."""
    ids_BT = sequence_ids(inputs, values_BT.shape).to(values_BT.device)
    count = int(ids_BT.max()) + 1
    return torch.zeros(count, dtype=values_BT.dtype, device=values_BT.device).index_add_(
        0, ids_BT.reshape(-1), values_BT.reshape(-1)
    )


class TokenReduction:
    """Reduction of per-token values under per-token weights ``w``.

    - ``token_mean``: ``Σ w·x / Σ w`` over the whole batch;
    - ``token_sum``: ``Σ w·x``;
    - ``sequence_mean``: mean over sequences of ``Σ_t w·x / Σ_t w`` (each sequence counts equally).
    """

    def __init__(self, reduction: Reduction = "token_mean") -> None:
        if reduction not in REDUCTIONS:
            raise ConfigurationError(f"unknown reduction {reduction!r}; use one of {REDUCTIONS}")
        self.reduction = reduction

    def normalizer(self, inputs: Mapping[str, Any]) -> float:
        """Denominator for the whole batch; raises if no token is supervised."""
        weights_BT = token_weights(inputs)
        if float(weights_BT.sum()) <= 0:
            raise InvalidInputError("the batch has no supervised token (every label is ignored or has weight 0)")
        if self.reduction == "token_mean":
            return float(weights_BT.sum())
        if self.reduction == "sequence_mean":
            return float((per_sequence_sums(weights_BT, inputs) > 0).sum())
        return 1.0

    def reduce(
        self, values_BT: torch.Tensor, inputs: Mapping[str, Any], normalizer: float | None = None
    ) -> tuple[torch.Tensor, int]:
        """``(scalar, supervised_tokens)``; pass the whole batch's ``normalizer`` for micro-batches."""
        weights_BT = token_weights(inputs).to(values_BT.device)
        if normalizer is None:
            normalizer = self.normalizer(inputs)
        weighted_BT = values_BT * weights_BT
        if self.reduction == "sequence_mean":
            totals_S = per_sequence_sums(weights_BT, inputs)
            sums_S = per_sequence_sums(weighted_BT, inputs)
            total = (sums_S / totals_S.clamp(min=torch.finfo(totals_S.dtype).tiny)).sum()
        else:
            total = weighted_BT.sum()
        return total / normalizer, int((weights_BT > 0).sum())
