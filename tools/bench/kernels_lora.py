"""Forward plus backward of many LoRA adapters on one batch: the per-adapter loop against the Triton SGMV kernel.

The loop (``multi_lora_delta_reference``, what ``MultiLoraLinear`` does today)
costs one gather, two skinny matmuls and one ``index_add`` per adapter, forward
and again backward; the kernel (``TritonMultiLora.fast``) sorts the rows by
adapter once and runs each matmul as one launch over all adapters. Both sides
get the same inputs and upstream gradient, take turns call by call (the one
going first alternating), and report their median milliseconds per
forward + backward. On CPU only the loop is timed: Triton runs there only in
its interpreter, which is a test path, not a fast one.

``bench_multi_lora`` returns its figures; the runner prints them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from twinkle.kernel.multi_lora import LoraTriple, TritonMultiLora, multi_lora_delta_reference

Delta = Callable[[torch.Tensor, Sequence[LoraTriple], torch.Tensor], torch.Tensor]


def _inputs(
    n_rows: int, in_features: int, out_features: int, n_adapters: int, rank: int, device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, list[LoraTriple], torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x_NI = torch.randn(n_rows, in_features, generator=generator).to(device, dtype).requires_grad_()
    loras = [
        (
            (torch.randn(rank, in_features, generator=generator) / in_features**0.5).to(device, dtype).requires_grad_(),
            (torch.randn(out_features, rank, generator=generator) / rank**0.5).to(device, dtype).requires_grad_(),
            2.0,
        )
        for _ in range(n_adapters)
    ]
    # Every row has an adapter, drawn uniformly and interleaved, as rows of a multi-tenant batch are.
    adapter_N = torch.randint(0, n_adapters, (n_rows,), generator=generator).to(device)
    grad_NO = torch.randn(n_rows, out_features, generator=generator).to(device, dtype)
    return x_NI, loras, adapter_N, grad_NO


def _step_ms(delta: Delta, x_NI: torch.Tensor, loras: list[LoraTriple], adapter_N: Any, grad_NO: Any) -> float:
    """One forward + backward (gradients of x and every A, B), in milliseconds, the device synchronised."""
    if x_NI.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    delta_NO = delta(x_NI, loras, adapter_N)
    torch.autograd.grad(delta_NO, [x_NI, *(w for A, B, _ in loras for w in (A, B))], grad_NO)
    if x_NI.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def bench_multi_lora(
    n_rows: int, in_features: int, out_features: int, n_adapters: int, rank: int, device: str
) -> dict[str, Any]:
    """Median ms per forward + backward of the per-adapter loop and (on CUDA) the Triton kernel.

    bfloat16 on CUDA, float32 on CPU. ``max_abs_diff`` (CUDA only) is the
    largest difference between the two sides' outputs, evidence that both do
    the same work.
    """
    on_cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    x_NI, loras, adapter_N, grad_NO = _inputs(n_rows, in_features, out_features, n_adapters, rank, device, dtype)
    sides: dict[str, Delta] = {"reference": multi_lora_delta_reference}
    if on_cuda:
        sides["fast"] = TritonMultiLora().fast
    warmup, rounds = (3, 20) if on_cuda else (1, 3)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(warmup + rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for name in order:
            ms = _step_ms(sides[name], x_NI, loras, adapter_N, grad_NO)
            if round_ >= warmup:
                times[name].append(ms)
    figures: dict[str, Any] = {
        "n_rows": n_rows,
        "in_features": in_features,
        "out_features": out_features,
        "n_adapters": n_adapters,
        "rank": rank,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "reference_ms": statistics.median(times["reference"]),
    }
    if not on_cuda:
        figures["note"] = "CPU: only the per-adapter loop; Triton runs on CPU only in its interpreter, a test path"
        return figures
    with torch.no_grad():
        reference_NO = multi_lora_delta_reference(x_NI, loras, adapter_N)
        fast_NO = TritonMultiLora().fast(x_NI, loras, adapter_N)
    figures["fast_ms"] = statistics.median(times["fast"])
    figures["speedup"] = figures["reference_ms"] / figures["fast_ms"]
    figures["max_abs_diff"] = (fast_NO.float() - reference_NO.float()).abs().max().item()
    return figures
