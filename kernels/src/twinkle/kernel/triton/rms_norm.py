"""RMSNorm in Triton: one program per block of rows, statistics in float32, weight gradient reduced per program."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16


@triton.jit
def _forward(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    # As transformers does: the normalised input is rounded to the input dtype before the weight multiplies it.
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + offsets, (normed * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _backward(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    program = tl.program_id(0)
    rows = program * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None] * n_cols + cols[None, :]
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    normed = x * rstd[:, None]
    dnormed = dy * w[None, :]
    # d/dx of x·rstd(x): rstd · (dn − n · mean(dn · n)).
    dx = rstd[:, None] * (dnormed - normed * (tl.sum(dnormed * normed, axis=1) / n_cols)[:, None])
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + program * n_cols + cols, tl.sum(dy * normed, axis=0), mask=cols < n_cols)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_RD = x.reshape(-1, x.shape[-1]).contiguous()
        n_rows, n_cols = x_RD.shape
        y_RD = torch.empty(x_RD.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd_R = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block_d = triton.next_power_of_2(n_cols)
        grid = (triton.cdiv(n_rows, ROWS_PER_PROGRAM),)
        _forward[grid](x_RD, weight, y_RD, rstd_R, n_rows, n_cols, eps, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_D=block_d)
        ctx.save_for_backward(x_RD, weight, rstd_R)
        return y_RD.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x_RD, weight, rstd_R = ctx.saved_tensors
        n_rows, n_cols = x_RD.shape
        grid = (triton.cdiv(n_rows, ROWS_PER_PROGRAM),)
        dx_RD = torch.empty_like(x_RD)
        dw_PD = torch.empty(grid[0], n_cols, dtype=torch.float32, device=x_RD.device)
        dy_RD = dy.reshape(-1, n_cols).contiguous()
        block_d = triton.next_power_of_2(n_cols)
        _backward[grid](
            dy_RD, x_RD, weight, rstd_R, dx_RD, dw_PD, n_rows, n_cols, BLOCK_R=ROWS_PER_PROGRAM, BLOCK_D=block_d
        )
        return dx_RD.view(dy.shape), dw_PD.sum(0).to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    output: torch.Tensor = RMSNormFunction.apply(x, weight, eps)  # type: ignore[no-untyped-call]
    return output
