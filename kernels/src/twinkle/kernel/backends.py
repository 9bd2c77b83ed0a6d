"""Where each backend can run: Triton on CUDA (or on CPU in Triton's interpreter), torch-npu's ops on NPUs.

A kernel asks :func:`triton_unavailable_reason` / :func:`npu_unavailable_reason`
for the device of its input and falls back to its PyTorch reference when the
answer is a reason. The interpreter (``TRITON_INTERPRET=1``) runs Triton
kernels on CPU tensors, slowly, for tests; it is never taken for CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

__all__ = ["device_type", "npu_unavailable_reason", "triton_interpreted", "triton_unavailable_reason"]


def device_type(device: Any) -> str:
    """``"cuda"``, ``"cpu"``, ``"npu"`` ... of a ``torch.device``, a string, or ``None`` (CPU)."""
    if device is None:
        return "cpu"
    return str(getattr(device, "type", device)).split(":")[0]


@functools.cache
def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels are (or will be) decorated for its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}


def triton_unavailable_reason(device: Any) -> str | None:
    """Why a Triton kernel cannot run on ``device``, or ``None``."""
    if not _has_module("triton"):
        return "triton is not installed (pip install 'twinkle-kernels[triton]')"
    kind = device_type(device)
    if kind == "cuda" or (kind == "cpu" and triton_interpreted()):
        return None
    if kind == "cpu":
        return "Triton kernels need a CUDA device (CPU only under TRITON_INTERPRET=1, for testing)"
    return f"Triton kernels do not run on {kind} devices"


def npu_unavailable_reason(device: Any) -> str | None:
    """Why a torch-npu kernel cannot run on ``device``, or ``None``."""
    if not _has_module("torch_npu"):
        return "torch-npu is not installed (pip install 'twinkle-kernels[npu]' on an Ascend machine)"
    kind = device_type(device)
    return None if kind == "npu" else f"NPU kernels need an Ascend NPU device, got {kind}"
