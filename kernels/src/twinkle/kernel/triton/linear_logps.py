"""Fused output layer and label log-probabilities in Triton: ``[N, V]`` logits never exist in memory.

Low-rank terms enter as a second operand pair: every term's ``u`` scattered
into its rows and its own columns of a zero ``x_NR``, every ``B`` side by side
in ``w_VR``, so ``logits = hidden @ weight.T + x_NR @ w_VR.T`` and no copy of
``weight`` is made. :func:`forward_program` gives each block of tokens one program
that walks the vocabulary tile by tile, folding each logits tile into running
max / argmax, sum of exponentials, label logit and entropy. The backward
recomputes logits per (token chunk, vocabulary chunk) in :func:`grad_logits_program`,
which writes ``d out / d logits`` for that chunk only; torch matmuls turn it
into the gradients, so the backward holds ``chunk_size × vocab_chunk_size``
gradient logits at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from twinkle.data_format import IGNORE_INDEX
from twinkle.kernel.backends import triton_interpreted
from twinkle.kernel.linear_logps import TRITON_DTYPES, LowRankTerms
from twinkle.kernel.triton.linear_logps_programs import forward_program, grad_logits_program

__all__ = ["DEFAULT_CHUNK_SIZE", "DEFAULT_VOCAB_CHUNK_SIZE", "LinearLogpsFunction", "linear_logps"]

BLOCK_N = 64  # tokens per program
# Vocabulary entries per logits tile. The interpreter pays per operation, not per element: it takes wider tiles.
BLOCK_V = 128
BLOCK_V_INTERPRETED = 4096
BLOCK_K = 64  # hidden (or rank) entries per tl.dot; tl.dot needs at least 16
# The backward's gradient logits: 4096 × 16384 entries, 128 MiB in bf16, big enough for efficient matmuls.
DEFAULT_CHUNK_SIZE = 4096
DEFAULT_VOCAB_CHUNK_SIZE = 16384


_HALF_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@functools.cache
def _dot_types(dtype: torch.dtype, interpreted: bool, allow_tf32: bool) -> tuple[Any, str]:
    """``tl.dot``'s operand type and precision for an operand pair of ``dtype``.

    The interpreter gets low-precision dots wrong, so it always multiplies in
    float32. On a GPU half precision stays in its type (tensor cores, float32
    accumulation); float32 honours torch's TF32 switch as ``torch.matmul`` would.
    """
    if interpreted or dtype not in _HALF_TYPES:
        return tl.float32, "tf32" if allow_tf32 and not interpreted else "ieee"
    return _HALF_TYPES[dtype], "ieee"


class _Stacked(NamedTuple):
    """The low-rank terms as one operand pair; ``ranks`` cut its columns back into the terms."""

    x_NR: torch.Tensor
    w_VR: torch.Tensor
    ranks: tuple[int, ...]


def _stack_low_rank(n_rows: int, positions: Sequence[torch.Tensor | None], factors: Sequence[torch.Tensor]) -> _Stacked:
    us, Bs = factors[0::2], factors[1::2]
    dtype = functools.reduce(torch.promote_types, (f.dtype for f in factors))
    ranks = tuple(B.shape[1] for B in Bs)
    x_NR = us[0].new_zeros(n_rows, sum(ranks), dtype=dtype)
    offset = 0
    for rows, u_nR, rank in zip(positions, us, ranks, strict=True):
        x_NR[slice(None) if rows is None else rows, offset : offset + rank] = u_nR.to(dtype)
        offset += rank
    return _Stacked(x_NR, torch.cat([B.to(dtype) for B in Bs], dim=1), ranks)


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its rows are contiguous (the kernels take a row stride only), else a copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _operands(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, low: _Stacked | None) -> dict[str, Any]:
    """The keyword arguments both kernels share: operands, their sizes and strides, and how to multiply them."""
    interpreted, allow_tf32 = triton_interpreted(), torch.backends.cuda.matmul.allow_tf32
    dot_dtype, precision = _dot_types(hidden_NH.dtype, interpreted, allow_tf32)  # weight's dtype too
    # Without terms the low-rank pointers are never read (HAS_LOW_RANK is off); any tensor stands in.
    x_NR, w_VR = (low.x_NR, low.w_VR) if low is not None else (hidden_NH, weight_VH)
    dot_dtype_r, precision_r = _dot_types(x_NR.dtype, interpreted, allow_tf32)
    return dict(
        x_ptr=hidden_NH,
        w_ptr=weight_VH,
        xr_ptr=x_NR,
        wr_ptr=w_VR,
        H=hidden_NH.shape[1],
        R=x_NR.shape[1] if low is not None else 0,
        stride_x=hidden_NH.stride(0),
        stride_w=weight_VH.stride(0),
        stride_xr=x_NR.stride(0),
        stride_wr=w_VR.stride(0),
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        DOT_DTYPE_R=dot_dtype_r,
        PRECISION_R=precision_r,
        HAS_LOW_RANK=low is not None,
        IGNORE=IGNORE_INDEX,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        BLOCK_V=BLOCK_V_INTERPRETED if interpreted else BLOCK_V,
    )


class LinearLogpsFunction(torch.autograd.Function):
    """Inputs ``hidden_NH, weight_VH, labels_N, positions, with_entropy, chunk_size, vocab_chunk_size, u_0, B_0, ...``.

    Outputs ``logps_N``, ``correct_N`` (not differentiable) and ``entropy_N``
    (``None`` without ``with_entropy``); gradients flow to hidden, weight and
    every ``u`` and ``B`` from both ``logps_N`` and ``entropy_N``.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        positions: tuple[torch.Tensor | None, ...],
        with_entropy: bool,
        chunk_size: int,
        vocab_chunk_size: int,
        *factors: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        hidden_NH, weight_VH, labels_N = _unit_stride(hidden_NH), _unit_stride(weight_VH), labels_N.contiguous()
        n_rows, n_vocab = hidden_NH.shape[0], weight_VH.shape[0]
        low = _stack_low_rank(n_rows, positions, factors) if factors else None
        new = functools.partial(torch.empty, n_rows, device=hidden_NH.device)
        logps_N, lse_N, argmax_N = new(dtype=torch.float32), new(dtype=torch.float32), new(dtype=torch.int32)
        entropy_N = new(dtype=torch.float32) if with_entropy else None
        if n_rows:
            forward_program[(triton.cdiv(n_rows, BLOCK_N),)](
                labels_ptr=labels_N,
                logps_ptr=logps_N,
                lse_ptr=lse_N,
                argmax_ptr=argmax_N,
                entropy_ptr=lse_N if entropy_N is None else entropy_N,
                N=n_rows,
                V=n_vocab,
                WITH_ENTROPY=with_entropy,
                **_operands(hidden_NH, weight_VH, low),
            )
        correct_N = (argmax_N == labels_N) & (labels_N != IGNORE_INDEX)
        ctx.mark_non_differentiable(correct_N)
        ctx.set_materialize_grads(False)  # a None gradient says which outputs the loss used
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N, lse_N, entropy_N, *(low[:2] if low else ()))
        ctx.ranks, ctx.positions = (low.ranks if low else ()), positions
        ctx.chunk_size, ctx.vocab_chunk_size = chunk_size, vocab_chunk_size
        ctx.factor_dtypes = [f.dtype for f in factors]
        return logps_N, correct_N, entropy_N

    @staticmethod
    def backward(  # one gradient per input of forward
        ctx: Any, grad_logps_N: torch.Tensor | None, _grad_correct: Any, grad_entropy_N: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden_NH, weight_VH, labels_N, lse_N, entropy_N, *stacked = ctx.saved_tensors
        if grad_logps_N is None and grad_entropy_N is None:
            return (None,) * (7 + len(ctx.factor_dtypes))
        low = _Stacked(stacked[0], stacked[1], ctx.ranks) if stacked else None
        (n_rows, n_hidden), n_vocab = hidden_NH.shape, weight_VH.shape[0]
        if grad_logps_N is None:
            grad_logps_N = lse_N.new_zeros(n_rows)
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        f32 = functools.partial(torch.zeros, dtype=torch.float32, device=hidden_NH.device)
        # Accumulated in float32; the weight's gradient one vocabulary chunk at a time.
        grad_hidden_NH = f32(n_rows, n_hidden) if need_hidden else None
        grad_weight_VH = torch.empty_like(weight_VH) if need_weight else None
        grad_low = None
        if low is not None and any(ctx.needs_input_grad[7:]):
            grad_low = _Stacked(f32(low.x_NR.shape), f32(low.w_VR.shape), low.ranks)
        chunk, vocab_chunk = max(1, min(ctx.chunk_size, n_rows)), min(ctx.vocab_chunk_size, n_vocab)  # N may be 0
        # In the weight's dtype, as the matmuls below take it (what a bf16 torch.matmul backward would do).
        buffer_CV = weight_VH.new_empty(chunk, vocab_chunk)
        operands = _operands(hidden_NH, weight_VH, low)
        grads = dict(
            labels_ptr=labels_N,
            lse_ptr=lse_N,
            grad_logps_ptr=grad_logps_N.contiguous(),
            entropy_ptr=lse_N if entropy_N is None else entropy_N,
            grad_entropy_ptr=lse_N if grad_entropy_N is None else grad_entropy_N.contiguous(),
            ENTROPY_GRAD=grad_entropy_N is not None,
        )
        for col0 in range(0, n_vocab, vocab_chunk):
            col_end = min(col0 + vocab_chunk, n_vocab)
            grad_w_chunk = f32(col_end - col0, n_hidden) if need_weight else None
            for row0 in range(0, n_rows, chunk):
                row_end = min(row0 + chunk, n_rows)
                grad_CV = buffer_CV[: row_end - row0, : col_end - col0]
                grid = (triton.cdiv(row_end - row0, BLOCK_N), triton.cdiv(col_end - col0, operands["BLOCK_V"]))
                grad_logits_program[grid](
                    out_ptr=grad_CV,
                    row0=row0,
                    row_end=row_end,
                    col0=col0,
                    col_end=col_end,
                    stride_out=grad_CV.stride(0),
                    **grads,
                    **operands,
                )
                if grad_hidden_NH is not None:
                    grad_hidden_NH[row0:row_end] += grad_CV @ weight_VH[col0:col_end]
                if grad_w_chunk is not None:
                    grad_w_chunk += grad_CV.T @ hidden_NH[row0:row_end]
                if low is not None and grad_low is not None:
                    grad_low_CV = grad_CV.to(low.x_NR.dtype)
                    grad_low.x_NR[row0:row_end] += grad_low_CV @ low.w_VR[col0:col_end]
                    grad_low.w_VR[col0:col_end] += grad_low_CV.T @ low.x_NR[row0:row_end]
            if grad_w_chunk is not None and grad_weight_VH is not None:
                grad_weight_VH[col0:col_end] = grad_w_chunk
        grad_hidden = None if grad_hidden_NH is None else grad_hidden_NH.to(hidden_NH.dtype)
        return grad_hidden, grad_weight_VH, None, None, None, None, None, *_factor_grads(ctx, grad_low)


def _factor_grads(ctx: Any, grad_low: _Stacked | None) -> list[torch.Tensor | None]:
    """The stacked operands' gradients cut back into each term's ``u`` and ``B``, in the factors' dtypes."""
    if grad_low is None:
        return [None] * len(ctx.factor_dtypes)
    grads: list[torch.Tensor | None] = []
    offset = 0
    for rows, rank, u_dtype, B_dtype in zip(
        ctx.positions, ctx.ranks, ctx.factor_dtypes[0::2], ctx.factor_dtypes[1::2], strict=True
    ):
        columns = slice(offset, offset + rank)
        grads.append(grad_low.x_NR[slice(None) if rows is None else rows, columns].to(u_dtype))
        grads.append(grad_low.w_VR[:, columns].to(B_dtype))
        offset += rank
    return grads


def linear_logps(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    low_rank: LowRankTerms = (),
    with_entropy: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_chunk_size: int = DEFAULT_VOCAB_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logps_N, correct_N, entropy_N or None)``; see :class:`LinearLogpsFunction`.

    ``hidden_NH`` and ``weight_VH`` share one of :data:`TRITON_DTYPES`.
    """
    if hidden_NH.dtype != weight_VH.dtype or hidden_NH.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"hidden and weight must share one of {TRITON_DTYPES}, got {hidden_NH.dtype}, {weight_VH.dtype}"
        )
    if chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(f"chunk sizes must be >= 1, got {chunk_size}, {vocab_chunk_size}")
    positions = tuple(term[0] for term in low_rank)
    factors = [tensor for term in low_rank for tensor in term[1:]]
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] = LinearLogpsFunction.apply(  # type: ignore[no-untyped-call]
        hidden_NH, weight_VH, labels_N, positions, with_entropy, chunk_size, vocab_chunk_size, *factors
    )
    return outputs
