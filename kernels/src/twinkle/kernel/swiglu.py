"""SwiGLU: ``silu(gate) · up``, the activation of the Llama, Qwen2 and Qwen3 MLPs.

The reference is the MLP's own arithmetic (``act_fn(gate) * up``), so a model
whose MLPs fall back to it computes exactly what it did before.
"""

from __future__ import annotations

import torch

from twinkle.interfaces import Kernel
from twinkle.kernel.backends import npu_unavailable_reason, triton_unavailable_reason
from twinkle.registry import register

__all__ = ["NpuSwiGLU", "TritonSwiGLU", "swiglu_reference"]


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


class _SwiGLU(Kernel):
    op = "swiglu"

    def reference(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu_reference(gate, up)


@register("kernel")
class TritonSwiGLU(_SwiGLU):
    backend = "triton"

    def unavailable_reason(self, device: object) -> str | None:
        return triton_unavailable_reason(device)

    def fast(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        from twinkle.kernel.triton.swiglu import swiglu

        return swiglu(gate, up)


@register("kernel")
class NpuSwiGLU(_SwiGLU):
    backend = "npu"

    def unavailable_reason(self, device: object) -> str | None:
        return npu_unavailable_reason(device)

    def fast(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        import torch_npu

        # torch-npu's swiglu splits its input in two halves along the last dim: silu(first) · second.
        output: torch.Tensor = torch_npu.npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)
        return output
