"""Rotary position embedding in Triton: ``x·cos + rotate_half(x)·sin`` on ``[B, H, T, D]`` views, any strides.

The backward is the rotation by the opposite angle, so both directions share one kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16


@triton.jit
def _rotate(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    n_heads,
    n_positions,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_cb,
    stride_ct,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INVERSE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (b, h, t) in row-major order
    b = rows // (n_heads * n_positions)
    h = (rows // n_positions) % n_heads
    t = rows % n_positions
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < HALF)
    x_at = x_ptr + (b * stride_xb + h * stride_xh + t * stride_xt)[:, None] + cols[None, :]
    c_at = (b * stride_cb + t * stride_ct)[:, None] + cols[None, :]
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + c_at + HALF, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:  # the gradient: the transposed rotation
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    out_at = out_ptr + rows[:, None] * (2 * HALF) + cols[None, :]
    tl.store(out_at, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_at + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


def _apply(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, inverse: bool) -> torch.Tensor:
    if x_BHTD.stride(-1) != 1:
        x_BHTD = x_BHTD.contiguous()
    batch, heads, positions, dim = x_BHTD.shape
    cos_BTD, sin_BTD = cos_BTD.expand(batch, positions, dim), sin_BTD.expand(batch, positions, dim)
    if cos_BTD.stride(-1) != 1 or cos_BTD.stride() != sin_BTD.stride():
        cos_BTD, sin_BTD = cos_BTD.contiguous(), sin_BTD.contiguous()
    dtype = torch.promote_types(x_BHTD.dtype, cos_BTD.dtype)
    out = torch.empty((batch, heads, positions, dim), dtype=dtype, device=x_BHTD.device)
    n_rows = batch * heads * positions
    _rotate[(triton.cdiv(n_rows, ROWS_PER_PROGRAM),)](
        x_BHTD,
        cos_BTD,
        sin_BTD,
        out,
        n_rows,
        heads,
        positions,
        *x_BHTD.stride()[:3],
        cos_BTD.stride(0),
        cos_BTD.stride(1),
        HALF=dim // 2,
        BLOCK_R=ROWS_PER_PROGRAM,
        BLOCK_HALF=triton.next_power_of_2(dim // 2),
        INVERSE=inverse,
    )
    return out


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos_BTD, sin_BTD)
        ctx.input_dtype = x_BHTD.dtype
        return _apply(x_BHTD, cos_BTD, sin_BTD, inverse=False)

    @staticmethod
    def backward(ctx: Any, grad_BHTD: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos_BTD, sin_BTD = ctx.saved_tensors
        return _apply(grad_BHTD, cos_BTD, sin_BTD, inverse=True).to(ctx.input_dtype), None, None


def rotary(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    output: torch.Tensor = RotaryFunction.apply(x_BHTD, cos_BTD, sin_BTD)  # type: ignore[no-untyped-call]
    return output
