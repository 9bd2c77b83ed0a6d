"""Per-token log-probabilities of label tokens without materialising ``[B, T, V]`` logits.

For a 151k vocabulary, full float32 logits of a batch of 8×4096 tokens take
20 GB. :func:`chunked_token_logps` walks over the tokens in chunks so only one
chunk's logits are alive at a time. When all chunks' probabilities fit in
``max_saved_bytes`` (4 GiB by default; a plain cross-entropy over the same
tokens keeps its logits *and* their log-softmax, twice as much) they are kept
for the backward, so nothing is computed twice; beyond that the backward
recomputes each chunk's logits instead of storing them (the trade made by
fused linear cross-entropy kernels: twinkle-kernels' ``TritonLinearLogps``
replaces this function in kernelized models). A chunk's logits become its
softmax in place, so one ``chunk × V`` buffer is alive at a time. Callers pass
only supervised positions, so prompt tokens cost nothing in the output layer. LoRA on the output layer
enters as :class:`LowRankTerm` s added to the logits inside the same chunks,
so an adapted ``lm_head`` keeps this path's speed and memory bound. On a CPU
the chunks' buffers are reused from pass to pass (:mod:`.chunk_buffers`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.module.chunk_buffers import ChunkBuffers

DEFAULT_MAX_SAVED_BYTES = 4 << 30
CPU_BUFFERS = ChunkBuffers()  # the chunks' logits buffers that CPU passes reuse


def logps_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probabilities are computed in: float32 for half-precision logits, else theirs (float64 stays)."""
    return torch.promote_types(dtype, torch.float32)


class TokenLogps(NamedTuple):
    """``logps_N`` (float32, or float64 for float64 weights; differentiable) and ``correct_N`` (argmax == label)."""

    logps: torch.Tensor
    correct: torch.Tensor


def token_logps_from_logits(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]`` per row, in :func:`logps_dtype`; 0 where the label is ignored."""
    logits_NV = logits_NV.to(logps_dtype(logits_NV.dtype))
    return _picked_logps(_label_logits(logits_NV, labels_N), labels_N, torch.logsumexp(logits_NV, dim=-1))


def _label_logits(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Each row's logit of its label (of token 0 where the label is ignored: :func:`_picked_logps` zeroes it)."""
    safe_N = torch.where(labels_N != IGNORE_INDEX, labels_N, 0)
    return logits_NV.gather(-1, safe_N.unsqueeze(-1)).squeeze(-1)


def _picked_logps(label_logits_N: torch.Tensor, labels_N: torch.Tensor, logsumexp_N: torch.Tensor) -> torch.Tensor:
    return torch.where(labels_N != IGNORE_INDEX, label_logits_N - logsumexp_N, 0.0)


class LowRankTerm(NamedTuple):
    """``u_nR @ B_VR.T`` added to the logits of the positions ``positions_n`` (all positions when ``None``).

    A LoRA adapter on the output layer is one such term: ``u = scaling · dropout(hidden) @ A.T``
    on the positions that use it. ``positions_n`` are increasing indices into the N positions.
    """

    positions_n: torch.Tensor | None
    u_nR: torch.Tensor
    B_VR: torch.Tensor


class _ChunkedTokenLogps(torch.autograd.Function):
    """``logps_N = log_softmax(hidden_NH @ weight_VH.T + low-rank terms)[labels_N]`` with O(chunk × V) live memory.

    The terms' ``(u, B)`` follow the fixed inputs as flat tensor arguments, so each gets its gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        chunk_size: int,
        save_probs: bool,
        positions: tuple[torch.Tensor | None, ...],
        *factors: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = logps_dtype(weight_VH.dtype)
        logps_N = torch.empty(labels_N.shape, dtype=dtype, device=hidden_NH.device)
        correct_N = torch.empty(labels_N.shape, dtype=torch.bool, device=hidden_NH.device)
        saved_probs = []
        terms = _terms(positions, factors)
        for start in range(0, hidden_NH.shape[0], chunk_size):
            end = start + chunk_size
            logits_CV = _chunk_logits(hidden_NH, weight_VH, terms, start, end, dtype)
            labels_C = labels_N[start:end]
            correct_N[start:end] = logits_CV.argmax(-1) == labels_C
            label_logits_C = _label_logits(logits_CV, labels_C)  # before the logits become probabilities
            logps_N[start:end] = _picked_logps(label_logits_C, labels_C, _softmax_(logits_CV))
            if save_probs:
                saved_probs.append(logits_CV)
            else:
                _release(logits_CV)
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, *factors)
        ctx.chunk_size, ctx.saved_probs, ctx.positions = chunk_size, saved_probs, positions
        ctx.mark_non_differentiable(correct_N)
        return logps_N, correct_N

    @staticmethod
    def backward(  # one gradient per input of forward
        ctx: Any, grad_logps_N: torch.Tensor, _grad_correct: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden_NH, weight_VH, labels_N, *factors = ctx.saved_tensors
        terms = _terms(ctx.positions, factors)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_NH) if need_hidden else None
        dtype = logps_dtype(weight_VH.dtype)
        grad_weight = torch.zeros(weight_VH.shape, dtype=dtype, device=weight_VH.device) if need_weight else None
        need_factors = ctx.needs_input_grad[6:]
        grad_factors = [
            torch.zeros_like(f, dtype=dtype) if need else None for f, need in zip(factors, need_factors, strict=True)
        ]
        for index, start in enumerate(range(0, hidden_NH.shape[0], ctx.chunk_size)):
            end = start + ctx.chunk_size
            hidden_CH, labels_C = hidden_NH[start:end], labels_N[start:end]
            if ctx.saved_probs:
                probs_CV = ctx.saved_probs[index]
            else:
                probs_CV = _chunk_logits(hidden_NH, weight_VH, terms, start, end, dtype)
                _softmax_(probs_CV)
            valid_C = labels_C != IGNORE_INDEX
            # d logp / d logits = onehot(label) - softmax(logits), scaled by the incoming gradient.
            scale_C = torch.where(valid_C, grad_logps_N[start:end].to(dtype), 0.0)
            grad_logits_CV = probs_CV.mul_(-scale_C.unsqueeze(-1))
            rows = valid_C.nonzero(as_tuple=True)[0]
            grad_logits_CV[rows, labels_C[rows]] += scale_C[rows]
            grad_logits_CV = grad_logits_CV.to(hidden_NH.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits_CV @ weight_VH
            if grad_weight is not None:
                grad_weight += (grad_logits_CV.T @ hidden_CH).to(dtype)
            for term, grad_u, grad_B in zip(terms, grad_factors[::2], grad_factors[1::2], strict=True):
                local, first, last = _in_chunk(term, start, end)
                rows = _rows(local)
                grad_CV = grad_logits_CV if rows is None else grad_logits_CV[rows]  # a view, unless scattered
                if grad_u is not None:
                    grad_u[first:last] = (grad_CV @ term.B_VR).to(dtype)
                if grad_B is not None:
                    grad_B += (grad_CV.T @ term.u_nR[first:last]).to(dtype)
            _release(probs_CV)  # nothing computed from it refers to it
        ctx.saved_probs = []
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VH.dtype)
        grads = [None if g is None else g.to(f.dtype) for g, f in zip(grad_factors, factors, strict=True)]
        return grad_hidden, grad_weight, None, None, None, None, *grads


def _softmax_(logits_CV: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp; ``logits_CV`` (the chunk's own buffer) becomes its softmax in place.

    ``torch.logsumexp`` and ``torch.softmax`` would each allocate a second ``[C, V]`` buffer.
    """
    max_C1 = logits_CV.amax(-1, keepdim=True)
    sum_C1 = logits_CV.sub_(max_C1).exp_().sum(-1, keepdim=True)
    logits_CV.div_(sum_C1)
    return (max_C1 + sum_C1.log()).squeeze(-1)


def _release(logits_CV: torch.Tensor) -> None:
    """Hand a chunk's buffer back to :data:`CPU_BUFFERS` (a CPU one: on other devices their allocator reuses it)."""
    if logits_CV.device.type == "cpu":
        CPU_BUFFERS.give(logits_CV)


def _terms(positions: tuple[torch.Tensor | None, ...], factors: Sequence[torch.Tensor]) -> list[LowRankTerm]:
    return [LowRankTerm(p, u, B) for p, u, B in zip(positions, factors[::2], factors[1::2], strict=True)]


def _in_chunk(term: LowRankTerm, start: int, end: int) -> tuple[torch.Tensor | None, int, int]:
    """The term's positions within chunk ``[start, end)`` (relative to it; ``None``: all) and its ``u`` rows there."""
    if term.positions_n is None:
        return None, start, end
    bounds = torch.searchsorted(term.positions_n, torch.tensor([start, end], device=term.positions_n.device))
    first, last = int(bounds[0]), int(bounds[1])
    return term.positions_n[first:last] - start, first, last


def _rows(local: torch.Tensor | None) -> slice | torch.Tensor | None:
    """A term's rows of a chunk as a slice when they are consecutive (one tenant's rows: a view, not a copy of
    ``[n, V]``), else the index tensor; ``None``: every row."""
    if local is None or not len(local) or int(local[-1]) - int(local[0]) + 1 != len(local):
        return local
    return slice(int(local[0]), int(local[-1]) + 1)


def _chunk_logits(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    terms: Sequence[LowRankTerm],
    start: int,
    end: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The chunk's logits in ``dtype``, in a buffer of its own (one of :data:`CPU_BUFFERS` where it can be)."""
    hidden_CH = hidden_NH[start:end]
    promoted = [factor.dtype for term in terms for factor in (term.u_nR, term.B_VR)]
    summed = functools.reduce(torch.promote_types, promoted, hidden_CH.dtype)  # the terms add as a + would
    if hidden_CH.device.type == "cpu" and hidden_CH.dtype == weight_VH.dtype == summed == dtype:
        buffer_CV = CPU_BUFFERS.take(hidden_CH.shape[0], weight_VH.shape[0], dtype)
        logits_CV = torch.mm(hidden_CH, weight_VH.T, out=buffer_CV)
    else:
        logits_CV = (hidden_CH @ weight_VH.T).to(summed)
    for term in terms:
        # In place: the logits are this chunk's own (autograd does not track inside the Function), and a copy
        # of the whole chunk per term (one per tenant with an adapted output layer) would cost more than it.
        local, first, last = _in_chunk(term, start, end)
        rows = _rows(local)
        if rows is None:
            logits_CV.addmm_(term.u_nR[first:last], term.B_VR.T)
        elif isinstance(rows, slice):
            logits_CV[rows].addmm_(term.u_nR[first:last], term.B_VR.T)
        else:
            logits_CV.index_add_(0, rows, term.u_nR[first:last] @ term.B_VR.T)
    return logits_CV.to(dtype)


def chunked_token_logps(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    chunk_size: int = 4096,
    max_saved_bytes: int = DEFAULT_MAX_SAVED_BYTES,
    low_rank: Sequence[LowRankTerm] = (),
) -> TokenLogps:
    """Log-probabilities of ``labels_N`` under the logits ``hidden_NH @ weight_VH.T`` plus the ``low_rank`` terms.

    The caller aligns hidden states and labels (for causal LMs: the hidden state
    of position ``t-1`` with the label of position ``t``). Ignored labels get 0.
    Memory is bounded by ``chunk_size × V`` plus, only if it fits in
    ``max_saved_bytes``, the probabilities kept for the backward.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    itemsize = torch.empty((), dtype=logps_dtype(weight_VH.dtype)).element_size()
    positions = tuple(term.positions_n for term in low_rank)
    factors = [tensor for term in low_rank for tensor in (term.u_nR, term.B_VR)]
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_NH, weight_VH, *factors))
    # Without a backward to come, each chunk's buffer is free (for the next chunk or pass) as soon as it is used.
    save_probs = backward and labels_N.numel() * weight_VH.shape[0] * itemsize <= max_saved_bytes
    logps_N, correct_N = _ChunkedTokenLogps.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        hidden_NH, weight_VH, labels_N, chunk_size, save_probs, positions, *factors
    )
    return TokenLogps(logps_N, correct_N)
