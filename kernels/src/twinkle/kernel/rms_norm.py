"""RMSNorm: ``weight · x / sqrt(mean(x²) + eps)``, as the Llama, Qwen2 and Qwen3 families compute it.

The reference is transformers' own arithmetic (statistics in float32, the
normalised input rounded to the input dtype before the weight multiplies it),
so a model whose norms fall back to it computes exactly what it did before.
"""

from __future__ import annotations

import torch

from twinkle.interfaces import Kernel
from twinkle.kernel.backends import npu_unavailable_reason, triton_unavailable_reason
from twinkle.registry import register

__all__ = ["NpuRMSNorm", "TritonRMSNorm", "rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x_float = x.to(torch.float32)
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class _RMSNorm(Kernel):
    op = "rms_norm"

    def reference(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_reference(x, weight, eps)


@register("kernel")
class TritonRMSNorm(_RMSNorm):
    backend = "triton"

    def unavailable_reason(self, device: object) -> str | None:
        return triton_unavailable_reason(device)

    def fast(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from twinkle.kernel.triton.rms_norm import rms_norm

        return rms_norm(x, weight, eps)


@register("kernel")
class NpuRMSNorm(_RMSNorm):
    backend = "npu"

    def unavailable_reason(self, device: object) -> str | None:
        return npu_unavailable_reason(device)

    def fast(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        import torch_npu

        output: torch.Tensor = torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
        return output
