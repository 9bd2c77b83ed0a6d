"""Output layer and label log-probabilities in one op: ``log_softmax(hidden @ weight.T + low-rank terms)[label]``.

A 151k vocabulary makes float32 logits of 32k tokens 20 GB, and their
backward as much again. The Triton kernel never forms them: forward, one
program per block of tokens walks the vocabulary in tiles with a streaming
log-sum-exp (and running argmax, label logit and entropy); backward recomputes
the logits per (token chunk, vocabulary chunk) and holds only that chunk's
gradient (``chunk_size × vocab_chunk_size`` entries) before torch matmuls
fold it into the gradients of hidden, weight and the low-rank factors. Beyond
the inputs and their gradients, memory is O(N + chunk_size × vocab_chunk_size)
(plus float32 accumulators of ``[N, H]`` and ``[vocab_chunk_size, H]``).

Low-rank terms (a LoRA on the output layer) are ``(positions_n, u_nR, B_VR)``
tuples, such as ``twinkle.module.LowRankTerm``: ``u_nR @ B_VR.T`` is added to
the logits of rows ``positions_n`` (every row when ``None``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.interfaces import Kernel
from twinkle.kernel.backends import triton_unavailable_reason
from twinkle.registry import register

__all__ = ["TRITON_DTYPES", "LinearLogps", "LowRankTerms", "TritonLinearLogps", "linear_logps_reference"]

# The dtypes the Triton kernel takes (hidden and weight share one); it computes in float32, so float64 inputs
# (and mixed hidden / weight dtypes) run the reference instead, which keeps float64.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

LowRankTerms = Sequence[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]  # (positions_n, u_nR, B_VR) per term


class LinearLogps(NamedTuple):
    """``logps_N`` (differentiable), ``correct_N`` (argmax == label) and ``entropy_N`` (``None`` unless asked for).

    Float32, or float64 where the inputs are; 0 / ``False`` where the label is ignored.
    """

    logps: torch.Tensor
    correct: torch.Tensor
    entropy: torch.Tensor | None


def linear_logps_reference(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    low_rank: LowRankTerms = (),
    with_entropy: bool = False,
) -> LinearLogps:
    """The definition: full ``[N, V]`` logits, ``log_softmax``, gather. Memory O(N × V)."""
    dtypes = [hidden_NH.dtype, weight_VH.dtype, torch.float32, *(t.dtype for _, u, B in low_rank for t in (u, B))]
    dtype = functools.reduce(torch.promote_types, dtypes)
    logits_NV = hidden_NH.to(dtype) @ weight_VH.to(dtype).T
    for positions_n, u_nR, B_VR in low_rank:
        term_nV = u_nR.to(dtype) @ B_VR.to(dtype).T
        logits_NV = logits_NV + term_nV if positions_n is None else logits_NV.index_add(0, positions_n, term_nV)
    log_probs_NV = torch.log_softmax(logits_NV, dim=-1)
    valid_N = labels_N != IGNORE_INDEX
    picked_N = log_probs_NV.gather(-1, torch.where(valid_N, labels_N, 0).unsqueeze(-1)).squeeze(-1)
    logps_N = torch.where(valid_N, picked_N, 0.0)
    correct_N = (logits_NV.argmax(-1) == labels_N) & valid_N
    entropy_N = None
    if with_entropy:
        entropy_N = torch.where(valid_N, -(log_probs_NV.exp() * log_probs_NV).sum(-1), 0.0)
    return LinearLogps(logps_N, correct_N, entropy_N)


@register("kernel")
class TritonLinearLogps(Kernel):
    """The fused Triton op; gradients flow from ``logps`` and ``entropy`` to hidden, weight and every ``u`` / ``B``.

    Inputs outside :data:`TRITON_DTYPES` (float64, or hidden and weight of
    different dtypes) take the reference on any device: see :meth:`__call__`.
    ``chunk_size`` (tokens) and ``vocab_chunk_size`` bound the backward's
    memory; they change no value, so the reference accepts and ignores them.
    """

    op = "linear_logps"
    backend = "triton"

    def unavailable_reason(self, device: Any) -> str | None:
        return triton_unavailable_reason(device)

    def reference(
        self,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        low_rank: LowRankTerms = (),
        with_entropy: bool = False,
        chunk_size: int | None = None,
        vocab_chunk_size: int | None = None,
    ) -> LinearLogps:
        return linear_logps_reference(hidden_NH, weight_VH, labels_N, low_rank, with_entropy)

    def fast(
        self,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        low_rank: LowRankTerms = (),
        with_entropy: bool = False,
        chunk_size: int | None = None,
        vocab_chunk_size: int | None = None,
    ) -> LinearLogps:
        from twinkle.kernel.triton.linear_logps import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE, linear_logps

        return LinearLogps(
            *linear_logps(
                hidden_NH,
                weight_VH,
                labels_N,
                low_rank,
                with_entropy,
                chunk_size or DEFAULT_CHUNK_SIZE,
                vocab_chunk_size or DEFAULT_VOCAB_CHUNK_SIZE,
            )
        )

    def __call__(self, hidden_NH: torch.Tensor, weight_VH: torch.Tensor, *args: Any, **kwargs: Any) -> LinearLogps:
        if hidden_NH.dtype != weight_VH.dtype or hidden_NH.dtype not in TRITON_DTYPES:
            return self.reference(hidden_NH, weight_VH, *args, **kwargs)
        output: LinearLogps = super().__call__(hidden_NH, weight_VH, *args, **kwargs)
        return output
