"""Multi-LoRA in Triton, SGMV style: rows grouped by adapter into segments, one launch per matmul for all adapters.

Rows are sorted by segment once per call (segment 0: rows with no adapter,
segment ``a + 1``: rows of adapter ``a``) and cut into blocks of
``BLOCK_M`` rows that never straddle two segments. Each program of
:func:`_segment_matmul` takes one block and multiplies its rows by its
adapter's matrix; :func:`_segment_outer` reduces one adapter's segment into its
weight gradient. Adapters are stacked, zero-padded to the largest rank, so
padding only adds zero terms. The block table is built on the device with
sorts and searches only, so a call never waits for the GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from twinkle.kernel.backends import triton_interpreted

__all__ = ["multi_lora_delta"]

BLOCK_M = 32  # rows per block; a segment of n rows takes ceil(n / BLOCK_M) blocks


@triton.jit
def _segment_matmul(
    in_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    blocks_ptr,
    scale_ptr,
    n_blocks,
    J,
    K,
    stride_in,
    stride_wa,
    stride_wj,
    stride_wk,
    stride_out,
    GATHER_IN: tl.constexpr,
    SCATTER_OUT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[p] = scale[a] * in[p] @ W[a].T`` for the rows ``p`` of one block of adapter ``a`` (zeros for no adapter).

    Row ``p`` counts in sorted order; ``GATHER_IN`` / ``SCATTER_OUT`` read or
    write the original row ``rows[p]`` instead, so no gathered copy exists.
    """
    block = tl.program_id(0)
    adapter = tl.load(blocks_ptr + block)
    start = tl.load(blocks_ptr + n_blocks + block)
    end = tl.load(blocks_ptr + 2 * n_blocks + block)
    p = start + tl.arange(0, BLOCK_M)
    p_mask = p < end
    in_rows = tl.load(rows_ptr + p, mask=p_mask, other=0) if GATHER_IN else p
    out_rows = tl.load(rows_ptr + p, mask=p_mask, other=0) if SCATTER_OUT else p
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    w_base = w_ptr + tl.maximum(adapter, 0).to(tl.int64) * stride_wa
    acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    # Rows with no adapter skip the loop and store zeros.
    for k0 in range(0, tl.where(adapter >= 0, K, 0), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x_offsets = in_rows.to(tl.int64)[:, None] * stride_in + k[None, :]
        x = tl.load(in_ptr + x_offsets, mask=p_mask[:, None] & (k[None, :] < K), other=0.0)
        w = tl.load(
            w_base + k[:, None] * stride_wk + j[None, :] * stride_wj,
            mask=(k[:, None] < K) & (j[None, :] < J),
            other=0.0,
        )
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    scale = tl.load(scale_ptr + tl.maximum(adapter, 0))
    out_offsets = out_rows.to(tl.int64)[:, None] * stride_out + j[None, :]
    tl.store(out_ptr + out_offsets, (acc * scale).to(out_ptr.dtype.element_ty), mask=p_mask[:, None] & (j[None, :] < J))


@triton.jit
def _segment_outer(
    left_ptr,
    right_ptr,
    out_ptr,
    rows_ptr,
    bounds_ptr,
    scale_ptr,
    J,
    K,
    stride_left,
    stride_right,
    stride_oa,
    stride_oj,
    GATHER_LEFT: tl.constexpr,
    GATHER_RIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[a] = scale[a] * left[seg].T @ right[seg]`` over the rows of adapter ``a``'s segment: a weight gradient."""
    adapter = tl.program_id(0)
    start = tl.load(bounds_ptr + adapter + 1)
    end = tl.load(bounds_ptr + adapter + 2)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    k = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_J, BLOCK_K), dtype=tl.float32)
    for p0 in range(start, end, BLOCK_M):
        p = p0 + tl.arange(0, BLOCK_M)
        p_mask = p < end
        left_rows = tl.load(rows_ptr + p, mask=p_mask, other=0) if GATHER_LEFT else p
        right_rows = tl.load(rows_ptr + p, mask=p_mask, other=0) if GATHER_RIGHT else p
        left = tl.load(
            left_ptr + left_rows.to(tl.int64)[None, :] * stride_left + j[:, None],
            mask=p_mask[None, :] & (j[:, None] < J),
            other=0.0,
        )
        right = tl.load(
            right_ptr + right_rows.to(tl.int64)[:, None] * stride_right + k[None, :],
            mask=p_mask[:, None] & (k[None, :] < K),
            other=0.0,
        )
        acc = tl.dot(left.to(DOT_DTYPE), right.to(DOT_DTYPE), acc, input_precision=PRECISION)
    out_offsets = adapter.to(tl.int64) * stride_oa + j[:, None] * stride_oj + k[None, :]
    tl.store(out_ptr + out_offsets, acc * tl.load(scale_ptr + adapter), mask=(j[:, None] < J) & (k[None, :] < K))


def _block(size: int) -> int:
    """A tile side for a dimension of ``size``: a power of two in 16..64 (``tl.dot`` needs at least 16)."""
    return min(64, max(16, int(triton.next_power_of_2(size))))


@functools.cache
def _dot_types(dtype: torch.dtype, interpreted: bool, allow_tf32: bool) -> tuple[Any, str]:
    """``tl.dot``'s operand type and precision for inputs of ``dtype``.

    The interpreter gets low-precision dots wrong, so it always multiplies in
    float32. On a GPU half-precision inputs stay in their own type (tensor
    cores, float32 accumulation) and float32 honours torch's TF32 switch, as
    ``torch.matmul`` would.
    """
    if interpreted or dtype == torch.float32:
        return tl.float32, "tf32" if allow_tf32 and not interpreted else "ieee"
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype], "ieee"


class _Routing:
    """The sorted order of the rows and their blocks, computed on the device without a host sync."""

    def __init__(self, adapter_N: torch.Tensor, n_adapters: int) -> None:
        # Any index outside [0, n_adapters) is segment 0 (no adapter), as in the reference.
        valid_N = (adapter_N >= 0) & (adapter_N < n_adapters)
        segment_N = torch.where(valid_N, adapter_N + 1, 0)
        self.rows_P = torch.argsort(segment_N, stable=True).to(torch.int32)
        n_segments = n_adapters + 1
        segment_ids = torch.arange(n_segments + 1, device=adapter_N.device)
        # bounds[s]..bounds[s + 1] are segment s's positions in sorted order.
        self.bounds_S = torch.searchsorted(segment_N[self.rows_P.long()], segment_ids).to(torch.int32)
        blocks_S = (self.bounds_S.diff() + BLOCK_M - 1) // BLOCK_M
        last_block_S = blocks_S.cumsum(0)
        # Each segment wastes less than one block, so this many blocks always suffice; the rest stay empty.
        self.n_blocks = triton.cdiv(adapter_N.numel(), BLOCK_M) + n_segments
        block_B = torch.arange(self.n_blocks, device=adapter_N.device)
        segment_B = torch.searchsorted(last_block_S, block_B, right=True)
        used_B = segment_B < n_segments
        segment_B = segment_B.clamp(max=n_segments - 1)
        first_B = (last_block_S - blocks_S)[segment_B]
        start_B = self.bounds_S[segment_B] + (block_B - first_B) * BLOCK_M
        end_B = torch.where(used_B, torch.minimum(self.bounds_S[segment_B + 1], start_B + BLOCK_M), 0)
        # Rows [adapter, start, end) of each block; adapter -1 for rows with no adapter.
        self.blocks_3B = torch.stack([segment_B - 1, start_B, end_B]).to(torch.int32).contiguous()


def _matmul(
    in_: torch.Tensor,
    w_AJK: torch.Tensor,
    out: torch.Tensor,
    routing: _Routing,
    scale_A: torch.Tensor,
    *,
    gather_in: bool,
    scatter_out: bool,
    dtype: torch.dtype,
) -> None:
    """``out[rows] = scale[a] * in[rows] @ w[a].T`` per segment (see :func:`_segment_matmul`); ``w`` may be a view.

    ``dtype`` is the model's (x's): the operands are multiplied in it, see :func:`_dot_types`.
    """
    J, K = w_AJK.shape[1:]
    dot_dtype, precision = _dot_types(dtype, triton_interpreted(), torch.backends.cuda.matmul.allow_tf32)
    block_j = _block(J)
    grid = (routing.n_blocks, triton.cdiv(J, block_j))
    _segment_matmul[grid](
        in_,
        w_AJK,
        out,
        routing.rows_P,
        routing.blocks_3B,
        scale_A,
        routing.n_blocks,
        J,
        K,
        in_.stride(0),
        *w_AJK.stride(),
        out.stride(0),
        GATHER_IN=gather_in,
        SCATTER_OUT=scatter_out,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=BLOCK_M,
        BLOCK_J=block_j,
        BLOCK_K=_block(K),
    )


def _outer(
    left: torch.Tensor,
    right: torch.Tensor,
    routing: _Routing,
    scale_A: torch.Tensor,
    *,
    gather_left: bool,
    gather_right: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Per adapter ``a``: ``scale[a] * left[seg a].T @ right[seg a]``, as a float32 ``[A, J, K]``."""
    n_adapters, J, K = scale_A.numel(), left.shape[1], right.shape[1]
    out_AJK = torch.empty(n_adapters, J, K, dtype=torch.float32, device=left.device)
    dot_dtype, precision = _dot_types(dtype, triton_interpreted(), torch.backends.cuda.matmul.allow_tf32)
    block_j, block_k = _block(J), _block(K)
    grid = (n_adapters, triton.cdiv(J, block_j), triton.cdiv(K, block_k))
    _segment_outer[grid](
        left,
        right,
        out_AJK,
        routing.rows_P,
        routing.bounds_S,
        scale_A,
        J,
        K,
        left.stride(0),
        right.stride(0),
        out_AJK.stride(0),
        out_AJK.stride(1),
        GATHER_LEFT=gather_left,
        GATHER_RIGHT=gather_right,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=BLOCK_M,
        BLOCK_J=block_j,
        BLOCK_K=block_k,
    )
    return out_AJK


class MultiLoraFunction(torch.autograd.Function):
    """Inputs ``x_NI, adapter_N, scalings, A_0, B_0, A_1, B_1, ...``; gradients for ``x`` and every ``A``, ``B``."""

    @staticmethod
    def forward(
        ctx: Any, x_NI: torch.Tensor, adapter_N: torch.Tensor, scalings: tuple[float, ...], *weights: torch.Tensor
    ) -> torch.Tensor:
        As, Bs = weights[0::2], weights[1::2]
        n_adapters, rank = len(As), max(A.shape[0] for A in As)
        w_dtype = functools.reduce(torch.promote_types, (w.dtype for w in weights))
        A_ARI = x_NI.new_zeros(n_adapters, rank, x_NI.shape[1], dtype=w_dtype)
        B_AOR = x_NI.new_zeros(n_adapters, Bs[0].shape[0], rank, dtype=w_dtype)
        for a, (A, B) in enumerate(zip(As, Bs, strict=True)):
            A_ARI[a, : A.shape[0]] = A
            B_AOR[a, :, : B.shape[1]] = B
        x_NI = x_NI.contiguous()
        n_rows, dtype = x_NI.shape[0], x_NI.dtype
        routing = _Routing(adapter_N, n_adapters)
        scale_A = torch.tensor(scalings, dtype=torch.float32, device=x_NI.device)
        ones_A = torch.ones_like(scale_A)
        # y stays float32 (in sorted row order): the expand and the gradient of B read it again.
        y_PR = x_NI.new_empty(n_rows, rank, dtype=torch.float32)
        _matmul(x_NI, A_ARI, y_PR, routing, ones_A, gather_in=True, scatter_out=False, dtype=dtype)
        delta_NO = x_NI.new_empty(n_rows, B_AOR.shape[1])
        _matmul(y_PR, B_AOR, delta_NO, routing, scale_A, gather_in=False, scatter_out=True, dtype=dtype)
        ctx.save_for_backward(x_NI, A_ARI, B_AOR, y_PR, scale_A, ones_A)
        ctx.routing = routing
        ctx.ranks = [A.shape[0] for A in As]
        ctx.dtypes = [w.dtype for w in weights]
        return delta_NO

    @staticmethod
    def backward(ctx: Any, grad_NO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_NI, A_ARI, B_AOR, y_PR, scale_A, ones_A = ctx.saved_tensors
        routing: _Routing = ctx.routing
        grad_NO, dtype = grad_NO.contiguous(), x_NI.dtype
        # grad_y = scaling * grad_out @ B and grad_x = grad_y @ A: matmuls by B.T and A.T, read as views (no copy).
        grad_y_PR = torch.empty_like(y_PR)
        B_ARO, A_AIR = B_AOR.transpose(1, 2), A_ARI.transpose(1, 2)
        _matmul(grad_NO, B_ARO, grad_y_PR, routing, scale_A, gather_in=True, scatter_out=False, dtype=dtype)
        grad_x_NI = None
        if ctx.needs_input_grad[0]:
            grad_x_NI = torch.empty_like(x_NI)
            _matmul(grad_y_PR, A_AIR, grad_x_NI, routing, ones_A, gather_in=False, scatter_out=True, dtype=dtype)
        if not any(ctx.needs_input_grad[3:]):
            return grad_x_NI, None, None, *(None for _ in ctx.dtypes)
        # The weight gradients reduce each segment in Triton too: one launch for all adapters, and the
        # segment bounds stay on the device (per-adapter torch matmuls would need them on the host).
        grad_A_ARI = _outer(grad_y_PR, x_NI, routing, ones_A, gather_left=False, gather_right=True, dtype=dtype)
        grad_B_AOR = _outer(grad_NO, y_PR, routing, scale_A, gather_left=True, gather_right=False, dtype=dtype)
        grads = [grad for a, rank in enumerate(ctx.ranks) for grad in (grad_A_ARI[a, :rank], grad_B_AOR[a, :, :rank])]
        return grad_x_NI, None, None, *(grad.to(w_dtype) for grad, w_dtype in zip(grads, ctx.dtypes, strict=True))


def multi_lora_delta(
    x_NI: torch.Tensor, loras: Sequence[tuple[torch.Tensor, torch.Tensor, float]], adapter_N: torch.Tensor
) -> torch.Tensor:
    """``scaling_a * x_n @ A_a.T @ B_a.T`` for every row ``n`` of adapter ``a = adapter_N[n]``; 0 for other rows.

    ``x_NI`` is ``[N, I]``, ``A_a`` ``[r_a, I]``, ``B_a`` ``[O, r_a]``; ``loras`` must not be empty.
    """
    weights = [w for A, B, _ in loras for w in (A, B)]
    scalings = tuple(float(scaling) for _, _, scaling in loras)
    delta_NO: torch.Tensor = MultiLoraFunction.apply(x_NI, adapter_N, scalings, *weights)  # type: ignore[no-untyped-call]
    return delta_NO
