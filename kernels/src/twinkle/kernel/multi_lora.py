"""Multi-LoRA: many adapters' low-rank updates on one batch, each row choosing its adapter (or none).

``delta[n] = scaling_a * x[n] @ A_a.T @ B_a.T`` with ``a = adapter_N[n]``. The
reference loops over the adapters: one gather, two skinny matmuls and one
scatter each, so a batch of many adapters costs many small launches. The
Triton kernel does it SGMV style (segmented gather matrix-vector, as in
Punica and S-LoRA): the rows are sorted by adapter into segments once, the
adapters stacked, and each matmul (the "shrink" ``x @ A.T`` to the rank, the
"expand" ``@ B.T`` back out, and their gradients) is one launch over every
segment at once, whatever the number of adapters and their ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Kernel
from twinkle.kernel.backends import triton_unavailable_reason
from twinkle.registry import register

__all__ = ["LoraTriple", "TritonMultiLora", "multi_lora_delta_reference"]

LoraTriple = tuple[torch.Tensor, torch.Tensor, float]
"""One adapter: ``A_RI`` ``[rank, in_features]``, ``B_OR`` ``[out_features, rank]``, ``scaling``."""

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def multi_lora_delta_reference(
    x_NI: torch.Tensor, loras: Sequence[LoraTriple], adapter_N: torch.Tensor
) -> torch.Tensor:
    """The update of every row ``x_NI[n]`` by adapter ``loras[adapter_N[n]]``; 0 where ``adapter_N`` is -1.

    ``x_NI`` is ``[N, I]`` and ``adapter_N`` ``[N]`` integers; an index outside
    ``[0, len(loras))`` counts as no adapter. Matmuls run in ``x``'s dtype, as
    ``nn.Linear`` would; the result is ``[N, O]`` in that dtype.
    """
    _check(x_NI, loras, adapter_N)
    delta_NO = x_NI.new_zeros(x_NI.shape[0], loras[0][1].shape[0])
    for a, (A_RI, B_OR, scaling) in enumerate(loras):
        rows_n = (adapter_N == a).nonzero(as_tuple=True)[0]
        delta_nO = x_NI.index_select(0, rows_n) @ A_RI.T @ B_OR.T * scaling
        delta_NO = delta_NO.index_add(0, rows_n, delta_nO)
    return delta_NO


def _check(x_NI: torch.Tensor, loras: Sequence[LoraTriple], adapter_N: torch.Tensor) -> None:
    if not loras:
        raise InvalidInputError("multi_lora needs at least one adapter (it takes out_features from B)")
    if x_NI.dim() != 2 or adapter_N.shape != x_NI.shape[:1]:
        raise InvalidInputError(
            f"multi_lora takes x [N, I] and adapter_N [N], got x {list(x_NI.shape)} and {list(adapter_N.shape)}"
        )
    out_features = loras[0][1].shape[0]
    for a, (A_RI, B_OR, _) in enumerate(loras):
        if A_RI.dim() != 2 or A_RI.shape[1] != x_NI.shape[1] or tuple(B_OR.shape) != (out_features, A_RI.shape[0]):
            raise InvalidInputError(
                f"adapter {a}: A must be [rank, {x_NI.shape[1]}] and B [{out_features}, rank], "
                f"got A {list(A_RI.shape)} and B {list(B_OR.shape)}"
            )


def _dtype_reason(dtype: torch.dtype) -> str:
    return f"the Triton multi-LoRA kernel takes float32, bfloat16 or float16, not {dtype}"


@register("kernel")
class TritonMultiLora(Kernel):
    """:func:`multi_lora_delta_reference` as segment-grouped Triton kernels (forward and backward)."""

    op = "multi_lora"
    backend = "triton"

    def unavailable_reason(self, device: object, dtype: torch.dtype | None = None) -> str | None:
        """Also refuses dtypes other than float32/bfloat16/float16 when ``dtype`` is given (see :meth:`__call__`)."""
        if dtype is not None and dtype not in _TRITON_DTYPES:
            return _dtype_reason(dtype)
        return triton_unavailable_reason(device)

    def __call__(self, x_NI: torch.Tensor, loras: Sequence[LoraTriple], adapter_N: torch.Tensor) -> torch.Tensor:
        # The dtype matters as much as the device: float64 (a gradcheck, say) takes the reference.
        if self.unavailable_reason(x_NI.device, x_NI.dtype) is None:
            return self.fast(x_NI, loras, adapter_N)
        return self.reference(x_NI, loras, adapter_N)

    def reference(self, x_NI: torch.Tensor, loras: Sequence[LoraTriple], adapter_N: torch.Tensor) -> torch.Tensor:
        return multi_lora_delta_reference(x_NI, loras, adapter_N)

    def fast(self, x_NI: torch.Tensor, loras: Sequence[LoraTriple], adapter_N: torch.Tensor) -> torch.Tensor:
        """The Triton path: float32 accumulation, output in ``x``'s dtype; raises on dtypes it does not take."""
        _check(x_NI, loras, adapter_N)
        if x_NI.dtype not in _TRITON_DTYPES:
            raise InvalidInputError(_dtype_reason(x_NI.dtype))
        from twinkle.kernel.triton.multi_lora import multi_lora_delta

        return multi_lora_delta(x_NI, loras, adapter_N)
