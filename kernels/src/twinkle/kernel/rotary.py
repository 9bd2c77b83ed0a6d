"""Rotary position embedding of queries and keys, as transformers' ``apply_rotary_pos_emb`` computes it.

``q`` and ``k`` are ``[B, H, T, D]`` (views of any strides, as attention
modules pass them), ``cos`` and ``sin`` ``[B, T, D]`` (broadcast over heads).
The reference is transformers' arithmetic, so a fallback computes exactly what
the model did before. The fast paths cover the full-dimension rotation the
Llama, Qwen2 and Qwen3 families use (``unsqueeze_dim=1``); anything else runs
the reference.
"""

from __future__ import annotations

import torch

from twinkle.interfaces import Kernel
from twinkle.kernel.backends import npu_unavailable_reason, triton_unavailable_reason
from twinkle.registry import register

__all__ = ["NpuRotary", "TritonRotary", "rotary_reference"]

QK = tuple[torch.Tensor, torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> QK:
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _fast_path_fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, unsqueeze_dim: int) -> bool:
    dim = q.shape[-1]
    return unsqueeze_dim == 1 and q.dim() == k.dim() == 4 and cos.dim() == 3 and cos.shape[-1] == dim and dim % 2 == 0


class _Rotary(Kernel):
    op = "rotary"

    def reference(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> QK:
        return rotary_reference(q, k, cos, sin, unsqueeze_dim)


@register("kernel")
class TritonRotary(_Rotary):
    backend = "triton"

    def unavailable_reason(self, device: object) -> str | None:
        return triton_unavailable_reason(device)

    def fast(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> QK:
        if not _fast_path_fits(q, k, cos, unsqueeze_dim):
            return rotary_reference(q, k, cos, sin, unsqueeze_dim)
        from twinkle.kernel.triton.rotary import rotary

        return rotary(q, cos, sin), rotary(k, cos, sin)


@register("kernel")
class NpuRotary(_Rotary):
    backend = "npu"

    def unavailable_reason(self, device: object) -> str | None:
        return npu_unavailable_reason(device)

    def fast(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> QK:
        if not _fast_path_fits(q, k, cos, unsqueeze_dim):
            return rotary_reference(q, k, cos, sin, unsqueeze_dim)
        import torch_npu

        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)
