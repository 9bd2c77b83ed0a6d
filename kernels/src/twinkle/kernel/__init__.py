"""Twinkle kernels: fast implementations of a model's hot operations, each behind :class:`twinkle.interfaces.Kernel`.

Every kernel has a PyTorch reference it is tested against and falls back to
where its backend (Triton on CUDA, torch-npu on Ascend) cannot run, so CPU
users keep working models. :func:`kernelize` puts kernels into a model by a
mapping (per model family by default) and :func:`unkernelize` takes them out;
:func:`get_kernel_report` says what was replaced with what.
"""

from twinkle.kernel.families import DEFAULT_MAPPINGS, OUTPUT_LOGPS, default_mapping
from twinkle.kernel.grouped_matmul import NpuGroupedMatmul, grouped_matmul_reference
from twinkle.kernel.kernelize import (
    KernelReport,
    ReportEntry,
    get_kernel_report,
    kernelize,
    rekernelize,
    select_kernel,
    unkernelize,
)
from twinkle.kernel.linear_logps import LinearLogps, TritonLinearLogps, linear_logps_reference
from twinkle.kernel.multi_lora import TritonMultiLora, multi_lora_delta_reference
from twinkle.kernel.rms_norm import NpuRMSNorm, TritonRMSNorm, rms_norm_reference
from twinkle.kernel.rotary import NpuRotary, TritonRotary, rotary_reference
from twinkle.kernel.swiglu import NpuSwiGLU, TritonSwiGLU, swiglu_reference

__all__ = [
    "DEFAULT_MAPPINGS",
    "OUTPUT_LOGPS",
    "KernelReport",
    "LinearLogps",
    "NpuGroupedMatmul",
    "NpuRMSNorm",
    "NpuRotary",
    "NpuSwiGLU",
    "ReportEntry",
    "TritonLinearLogps",
    "TritonMultiLora",
    "TritonRMSNorm",
    "TritonRotary",
    "TritonSwiGLU",
    "default_mapping",
    "get_kernel_report",
    "grouped_matmul_reference",
    "kernelize",
    "linear_logps_reference",
    "multi_lora_delta_reference",
    "rekernelize",
    "rms_norm_reference",
    "rotary_reference",
    "select_kernel",
    "swiglu_reference",
    "unkernelize",
]
