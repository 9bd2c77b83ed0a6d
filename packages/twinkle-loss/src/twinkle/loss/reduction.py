"""How per-token loss values become one scalar, identically for padded and packed batches.

A batch may be split into micro-batches; to get the gradient of the whole
batch, every micro-batch divides by the *whole batch's* normaliser (tokens or
sequences), which :meth:`TokenReduction.normalizer` computes up front.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol

import torch

from twinkle.errors import ConfigurationError, InvalidInputError

Reduction = Literal["token_mean", "token_sum", "sequence_mean"]
REDUCTIONS: tuple[str, ...] = ("token_mean", "token_sum", "sequence_mean")


def token_weights(inputs: Mapping[str, Any]) -> torch.Tensor:
    """Per-token weights ``[B, T]``: ``loss_weights`` when given (float), else ``loss_mask``."""
    weights: torch.Tensor | None = inputs.get("loss_weights")
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


def _require_supervised(weights_BT: torch.Tensor) -> torch.Tensor:
    if float(weights_BT.sum()) <= 0:
        raise InvalidInputError("the batch has no supervised token (every label is ignored or has weight 0)")
    return weights_BT


class Reducer(Protocol):
    """How a loss turns per-token values into its scalar (see :class:`TokenReduction`)."""

    def normalizer(self, inputs: Mapping[str, Any]) -> float:
        """The whole batch's denominator, passed back to :meth:`reduce` for each micro-batch."""
        ...

    def reduce(
        self, values_BT: torch.Tensor, inputs: Mapping[str, Any], normalizer: float | None = None
    ) -> tuple[torch.Tensor, int]:
        """``(scalar, supervised_tokens)``."""
        ...


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
        weights_BT = _require_supervised(token_weights(inputs))
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


class ConstantLengthReduction:
    """``Σ w·x / (num_sequences · max_length)``: Dr. GRPO's length-unbiased aggregation.

    Dividing every sequence's token sum by the same constant (the generation
    budget) instead of by its own length removes the bias that favours long
    wrong answers and short right ones (Liu et al. 2025, "Understanding
    R1-Zero-Like Training", §3.1). ``num_sequences`` counts every sample of the
    batch, as the paper's ``1/G`` does.
    """

    def __init__(self, max_length: int) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ConfigurationError(f"max_length must be a positive int (the generation budget), got {max_length!r}")
        self.max_length = max_length

    def normalizer(self, inputs: Mapping[str, Any]) -> float:
        """``num_sequences · max_length``; raises if a sequence trains more than ``max_length`` tokens."""
        weights_BT = _require_supervised(token_weights(inputs))
        counts_S = per_sequence_sums((weights_BT > 0).float(), inputs)
        longest = int(counts_S.max())
        if longest > self.max_length:
            raise InvalidInputError(
                f"sequence {int(counts_S.argmax())} trains {longest} tokens, more than max_length={self.max_length}; "
                "max_length must be the generation budget (the longest possible completion)"
            )
        return float(counts_S.numel() * self.max_length)

    def reduce(
        self, values_BT: torch.Tensor, inputs: Mapping[str, Any], normalizer: float | None = None
    ) -> tuple[torch.Tensor, int]:
        """``(scalar, supervised_tokens)``; pass the whole batch's ``normalizer`` for micro-batches."""
        weights_BT = token_weights(inputs).to(values_BT.device)
        if normalizer is None:
            normalizer = self.normalizer(inputs)
        return (values_BT * weights_BT).sum() / normalizer, int((weights_BT > 0).sum())


def as_reducer(reduction: Reduction | Reducer) -> Reducer:
    """A reduction name (see :data:`REDUCTIONS`) as a :class:`TokenReduction`; a reducer object as it is."""
    if isinstance(reduction, str):
        return TokenReduction(reduction)
    if not (callable(getattr(reduction, "normalizer", None)) and callable(getattr(reduction, "reduce", None))):
        raise ConfigurationError(
            f"reduction must be one of {REDUCTIONS} or an object with normalizer() and reduce(), got {reduction!r}"
        )
    return reduction
