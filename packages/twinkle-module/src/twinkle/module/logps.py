"""Per-token log-probabilities of label tokens without materialising ``[B, T, V]`` logits.

For a 151k vocabulary, full float32 logits of a batch of 8×4096 tokens take
20 GB. :func:`chunked_token_logps` walks over the tokens in chunks so only one
chunk's logits are alive at a time; they become their exponentials (less the
row's maximum) in place. Callers pass only supervised positions, so prompt
tokens cost nothing in the output layer.

What the backward needs of each chunk depends on what is trained. When only
the layers below the output layer are (LoRA on the decoder, the usual case),
the gradient is linear in the loss's per-token scale, so the forward keeps just
the softmax's product with the output layer (``[N, H]``, computed while the
chunk is in cache) and nothing ``× V`` outlives its chunk. When the output
layer is trained, the probabilities are kept if they fit in
``max_saved_bytes`` (4 GiB by default; a plain cross-entropy keeps its logits
*and* their log-softmax, twice as much), else the backward recomputes each
chunk's logits (the trade made by fused linear cross-entropy kernels:
twinkle-kernels' ``TritonLinearLogps`` replaces this function in kernelized
models). LoRA on the output layer enters as :class:`LowRankTerm` s added to
the logits inside the same chunks, so an adapted ``lm_head`` keeps this path's
speed and memory bound. On a CPU the chunks' buffers are reused from pass to
pass (:mod:`.chunk_buffers`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from twinkle.data_format import IGNORE_INDEX
from twinkle.module.chunk_buffers import ChunkBuffers

DEFAULT_MAX_SAVED_BYTES = 4 << 30
CPU_CHUNK_BYTES = 64 << 20  # a CPU chunk's logits when none are kept for the backward (110 positions at V=151,936)
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

    The terms' ``(u, B)`` follow the fixed inputs as flat tensor arguments, so each gets its gradient. How the
    backward gets the softmax is the ``mode`` (see :func:`chunked_token_logps`): ``"project"`` keeps only its
    products with the output layer (``softmax @ W``, ``softmax @ B``), ``"save"`` keeps it, ``"recompute"``
    computes it again, ``"none"`` has no backward to come.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        chunk_size: int,
        mode: str,
        positions: tuple[torch.Tensor | None, ...],
        *factors: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = logps_dtype(weight_VH.dtype)
        logps_N = torch.empty(labels_N.shape, dtype=dtype, device=hidden_NH.device)
        correct_N = torch.empty(labels_N.shape, dtype=torch.bool, device=hidden_NH.device)
        saved_exps: list[tuple[torch.Tensor, torch.Tensor]] = []
        terms = _terms(positions, factors)
        projected = _Projected.empty(ctx, hidden_NH, terms) if mode == "project" else None
        for start in range(0, hidden_NH.shape[0], chunk_size):
            end = start + chunk_size
            spans = _spans(terms, start, end)
            logits_CV = _chunk_logits(hidden_NH, weight_VH, terms, spans, start, end, dtype)
            labels_C = labels_N[start:end]
            label_logits_C = _label_logits(logits_CV, labels_C)  # before the logits become exponentials
            max_C = logits_CV.amax(-1)
            correct_N[start:end] = _greedy_hits(logits_CV, labels_C, label_logits_C, max_C)
            sum_C = _exp_shifted_(logits_CV, max_C)
            logps_N[start:end] = _picked_logps(label_logits_C, labels_C, max_C + sum_C.log())
            if projected is not None:
                projected.add(logits_CV, sum_C, weight_VH, terms, spans, start, end)
            if mode == "save":
                saved_exps.append((logits_CV, sum_C))
            else:
                _release(logits_CV)
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, *factors)
        ctx.chunk_size, ctx.saved_exps, ctx.positions, ctx.projected = chunk_size, saved_exps, positions, projected
        ctx.mark_non_differentiable(correct_N)
        return logps_N, correct_N

    @staticmethod
    def backward(  # one gradient per input of forward
        ctx: Any, grad_logps_N: torch.Tensor, _grad_correct: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden_NH, weight_VH, labels_N, *factors = ctx.saved_tensors
        terms = _terms(ctx.positions, factors)
        if ctx.projected is not None:
            grad_hidden, grads = ctx.projected.gradients(grad_logps_N, labels_N, weight_VH, terms)
            ctx.projected = None
            return grad_hidden, None, None, None, None, None, *grads
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
            spans = _spans(terms, start, end)
            if ctx.saved_exps:
                exps_CV, sum_C = ctx.saved_exps[index]
            else:
                exps_CV = _chunk_logits(hidden_NH, weight_VH, terms, spans, start, end, dtype)
                sum_C = _exp_shifted_(exps_CV, exps_CV.amax(-1))
            valid_C = labels_C != IGNORE_INDEX
            # d logp / d logits = onehot(label) - softmax(logits), scaled by the incoming gradient; the softmax's
            # division folds into the scale (one pass over the chunk fewer).
            scale_C = torch.where(valid_C, grad_logps_N[start:end].to(dtype), 0.0)
            grad_logits_CV = exps_CV.mul_((-scale_C / sum_C).unsqueeze(-1))
            rows = valid_C.nonzero(as_tuple=True)[0]
            grad_logits_CV[rows, labels_C[rows]] += scale_C[rows]
            grad_logits_CV = grad_logits_CV.to(hidden_NH.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits_CV @ weight_VH
            if grad_weight is not None:
                _add_product_(grad_weight, grad_logits_CV.T, hidden_CH)
            for term, (rows, first, last), grad_u, grad_B in zip(
                terms, spans, grad_factors[::2], grad_factors[1::2], strict=True
            ):
                grad_CV = grad_logits_CV if rows is None else grad_logits_CV[rows]  # a view, unless scattered
                if grad_u is not None:
                    grad_u[first:last] = (grad_CV @ term.B_VR).to(dtype)
                if grad_B is not None:
                    _add_product_(grad_B, grad_CV.T, term.u_nR[first:last])
            _release(exps_CV)  # nothing computed from it refers to it
        ctx.saved_exps = []
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VH.dtype)
        grads = [None if g is None else g.to(f.dtype) for g, f in zip(grad_factors, factors, strict=True)]
        return grad_hidden, grad_weight, None, None, None, None, *grads


class _Projected:
    """The softmax's products with the output layer, gathered chunk by chunk in the forward (mode ``"project"``).

    When only the hidden states and the terms' ``u`` need gradients, the gradient is linear in the incoming
    ``scale`` (``d logp / d logits = onehot(label) - softmax``), so ``grad_hidden = scale * (W[label] - softmax
    @ W)`` and ``grad_u = scale * (B[label] - softmax @ B)``: the forward computes ``softmax @ W`` and ``softmax @
    B`` while each chunk is in cache, and keeps ``[N, H]`` and ``[n, R]`` instead of the ``[N, V]`` softmax.
    """

    def __init__(self, softmax_W_NH: torch.Tensor | None, softmax_B: list[torch.Tensor | None]) -> None:
        self.softmax_W_NH = softmax_W_NH
        self.softmax_B = softmax_B  # per term: [n, R] (None: its u needs no gradient)

    @classmethod
    def empty(cls, ctx: Any, hidden_NH: torch.Tensor, terms: Sequence[LowRankTerm]) -> _Projected:
        need_u = ctx.needs_input_grad[6::2]
        return cls(
            torch.empty_like(hidden_NH) if ctx.needs_input_grad[0] else None,
            [torch.empty_like(term.u_nR) if need else None for term, need in zip(terms, need_u, strict=True)],
        )

    def add(
        self,
        exps_CV: torch.Tensor,
        sum_C: torch.Tensor,
        weight_VH: torch.Tensor,
        terms: Sequence[LowRankTerm],
        spans: Sequence[Span],
        start: int,
        end: int,
    ) -> None:
        inverse_C1 = sum_C.reciprocal().unsqueeze(-1)
        if self.softmax_W_NH is not None:
            torch.mm(exps_CV, weight_VH, out=self.softmax_W_NH[start:end]).mul_(inverse_C1)
        for term, (rows, first, last), softmax_B_nR in zip(terms, spans, self.softmax_B, strict=True):
            if softmax_B_nR is not None:
                exps_cV, inverse_c1 = (exps_CV, inverse_C1) if rows is None else (exps_CV[rows], inverse_C1[rows])
                softmax_B_nR[first:last] = (exps_cV @ term.B_VR) * inverse_c1

    def gradients(
        self, grad_logps_N: torch.Tensor, labels_N: torch.Tensor, weight_VH: torch.Tensor, terms: Sequence[LowRankTerm]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """``grad_hidden`` and the factors' gradients (``u``'s where asked for; never ``B``'s)."""
        valid_N = labels_N != IGNORE_INDEX
        scale_N1 = torch.where(valid_N, grad_logps_N.to(weight_VH.dtype), 0.0).unsqueeze(-1)
        safe_N = torch.where(valid_N, labels_N, 0)
        grad_hidden = None
        if self.softmax_W_NH is not None:
            grad_hidden = weight_VH[safe_N].sub_(self.softmax_W_NH).mul_(scale_N1)
        grads: list[torch.Tensor | None] = []
        for term, softmax_B_nR in zip(terms, self.softmax_B, strict=True):
            grad_u = None
            if softmax_B_nR is not None:
                rows = slice(None) if term.positions_n is None else term.positions_n
                grad_u = term.B_VR[safe_N[rows]].sub_(softmax_B_nR).mul_(scale_N1[rows])
            grads += [grad_u, None]
        return grad_hidden, grads


def _add_product_(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """``total += left @ right``, in place when the dtypes agree (no ``[V, ·]`` temporary per chunk)."""
    if left.dtype == right.dtype == total.dtype:
        total.addmm_(left, right)
    else:
        total += (left @ right).to(total.dtype)


def _exp_shifted_(logits_CV: torch.Tensor, max_C: torch.Tensor) -> torch.Tensor:
    """Each row's sum of ``exp(logits - max)``; ``logits_CV`` (the chunk's own buffer) becomes those exponentials
    in place (the softmax but for the division by the sum, which the backward folds into its scale).

    ``torch.logsumexp`` and ``torch.softmax`` would each allocate a second ``[C, V]`` buffer.
    """
    return logits_CV.sub_(max_C.unsqueeze(-1)).exp_().sum(-1)


def _greedy_hits(
    logits_CV: torch.Tensor, labels_C: torch.Tensor, label_logits_C: torch.Tensor, max_C: torch.Tensor
) -> torch.Tensor:
    """``argmax(logits) == label`` per row, searching only the rows whose label's logit is the maximum.

    Only those rows can be hits, and only they need an argmax (the first maximum, as ``argmax`` ties go): a
    search of every row (a slow reduction on a CPU) cost a quarter of a small model's pass.
    """
    hits_C = (label_logits_C == max_C) & (labels_C != IGNORE_INDEX)
    rows = hits_C.nonzero(as_tuple=True)[0]
    if len(rows):
        hits_C[rows] = logits_CV[rows].max(-1).indices == labels_C[rows]
    return hits_C


def _release(logits_CV: torch.Tensor) -> None:
    """Hand a chunk's buffer back to :data:`CPU_BUFFERS` (a CPU one: on other devices their allocator reuses it)."""
    if logits_CV.device.type == "cpu":
        CPU_BUFFERS.give(logits_CV)


def _terms(positions: tuple[torch.Tensor | None, ...], factors: Sequence[torch.Tensor]) -> list[LowRankTerm]:
    return [LowRankTerm(p, u, B) for p, u, B in zip(positions, factors[::2], factors[1::2], strict=True)]


# A term's rows of a chunk (see :func:`_rows`) and the range of its ``u`` rows there.
Span = tuple[slice | torch.Tensor | None, int, int]


def _spans(terms: Sequence[LowRankTerm], start: int, end: int) -> list[Span]:
    """Each term's :data:`Span` in chunk ``[start, end)``, found once per chunk for every use of it."""
    return [_in_chunk(term, start, end) for term in terms]


def _in_chunk(term: LowRankTerm, start: int, end: int) -> Span:
    if term.positions_n is None:
        return None, start, end
    bounds = torch.searchsorted(term.positions_n, torch.tensor([start, end], device=term.positions_n.device))
    first, last = int(bounds[0]), int(bounds[1])
    return _rows(term.positions_n[first:last] - start), first, last


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
    spans: Sequence[Span],
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
    for term, (rows, first, last) in zip(terms, spans, strict=True):
        # In place: the logits are this chunk's own (autograd does not track inside the Function), and a copy
        # of the whole chunk per term (one per tenant with an adapted output layer) would cost more than it.
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
    Memory is bounded by ``chunk_size × V`` plus, when the output layer is
    trained and they fit in ``max_saved_bytes``, the probabilities kept for the
    backward. On a CPU, chunks whose logits are not kept are also capped at
    :data:`CPU_CHUNK_BYTES`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    positions = tuple(term.positions_n for term in low_rank)
    factors = [tensor for term in low_rank for tensor in (term.u_nR, term.B_VR)]
    mode = _backward_mode(hidden_NH, weight_VH, factors, labels_N.numel() * weight_VH.shape[0], max_saved_bytes)
    if mode in ("project", "none") and hidden_NH.device.type == "cpu":
        # Nothing × V outlives its chunk, so a cache-sized chunk is read from cache by each pass over it (the
        # matmul's output, max, exp, sum, the product with W): a pass of 8 tenants' 1,024 positions over a
        # 151,936-token vocabulary took 489 ms in such chunks against 657 ms in one chunk on a 2-core VM.
        itemsize = torch.empty((), dtype=logps_dtype(weight_VH.dtype)).element_size()
        chunk_size = min(chunk_size, max(1, CPU_CHUNK_BYTES // (weight_VH.shape[0] * itemsize)))
    logps_N, correct_N = _ChunkedTokenLogps.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        hidden_NH, weight_VH, labels_N, chunk_size, mode, positions, *factors
    )
    return TokenLogps(logps_N, correct_N)


def _backward_mode(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    factors: Sequence[torch.Tensor],
    softmax_numel: int,
    max_saved_bytes: int,
) -> str:
    """How the backward gets the softmax (see :class:`_ChunkedTokenLogps`); ``factors`` are the terms' ``(u, B)``.

    ``"project"`` when neither the output layer nor a term's ``B`` is trained and everything is in the logps'
    dtype (float32 or float64: half precision would round ``W[label] - softmax @ W`` of a confident row where
    the other modes round its small difference); else ``"save"`` when the softmax fits ``max_saved_bytes``.
    """
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_NH, weight_VH, *factors))):
        return "none"  # each chunk's buffer is free (for the next chunk or pass) as soon as it is used
    dtype = logps_dtype(weight_VH.dtype)
    trained_output = weight_VH.requires_grad or any(B_VR.requires_grad for B_VR in factors[1::2])
    if not trained_output and all(t.dtype == dtype for t in (hidden_NH, weight_VH, *factors)):
        return "project"
    itemsize = torch.empty((), dtype=dtype).element_size()
    return "save" if softmax_numel * itemsize <= max_saved_bytes else "recompute"
