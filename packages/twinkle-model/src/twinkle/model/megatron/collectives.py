"""The three tensor-parallel exchanges this back-end adds to megatron-core's layers, as autograd functions
(and :func:`scale_gradient`, for what every rank computes whole but the group's exchanges sum).

megatron-core's own (``tensor_parallel.mappings``) ask CUDA for the current device; these run on any
torch.distributed backend (gloo on CPU). Each is the identity for a group of one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the ranks' gradients (each used the input for its own part)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce forward (each rank holds a partial sum); the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """Every rank's slice along the last dimension, joined; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.size = rank, size
        slices = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(slices, tensor.contiguous(), group=group)
        return torch.cat(slices, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None, None, None


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor``, whose gradient is multiplied by ``factor`` in backward."""
    if factor == 1:
        return tensor
    result: torch.Tensor = _ScaleGradient.apply(tensor, factor)  # type: ignore[no-untyped-call]
    return result


def copy_to_group(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """``tensor``, whose gradient is summed over ``group`` in backward."""
    if size == 1:
        return tensor
    result: torch.Tensor = _CopyToGroup.apply(tensor, group)  # type: ignore[no-untyped-call]
    return result


def sum_over_group(tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """The sum of every rank's ``tensor``; the gradient reaches each rank's as it is."""
    if size == 1:
        return tensor
    result: torch.Tensor = _SumOverGroup.apply(tensor, group)  # type: ignore[no-untyped-call]
    return result


def gather_last_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None, rank: int, size: int) -> torch.Tensor:
    """Every rank's ``tensor`` joined along the last dimension, in rank order."""
    if size == 1:
        return tensor
    result: torch.Tensor = _GatherLastDim.apply(tensor, group, rank, size)  # type: ignore[no-untyped-call]
    return result
