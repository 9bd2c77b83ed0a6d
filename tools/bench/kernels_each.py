"""Each Triton kernel, forward + backward, against its PyTorch reference and Liger's kernel (CUDA only).

The sizes are a Qwen3-8B layer's on 8,192 tokens in bfloat16: RMSNorm over 4,096 features, SwiGLU over
12,288, rotary embedding of 32 query and 8 key heads of 128; and the output layer's label log-probs over
vocabulary 151,936 against Liger's fused linear cross-entropy (summed: the same gradients). Liger's kernels
are timed where ``liger-kernel`` is installed (``pip install liger-kernel``, in the benchmark only).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

TOKENS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 8192, 4096, 12288, 32, 8, 128, 151_936
Step = Callable[[], Any]


def _milliseconds(step: Step, warmup: int = 3, rounds: int = 20) -> float:
    """Median milliseconds of ``step`` (a forward and its backward) on the GPU."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _leaf(*size: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*size, device="cuda") * scale).to(torch.bfloat16).requires_grad_()


def _backward(output: Any) -> None:
    outputs = output if isinstance(output, tuple) else (output,)
    torch.autograd.backward([o.float().sum() for o in outputs])


def _steps() -> dict[str, dict[str, Step]]:
    """For each op, its implementations as zero-argument forward + backward steps on shared inputs."""
    from twinkle.kernel import (
        TritonLinearLogps,
        TritonRMSNorm,
        TritonRotary,
        TritonSwiGLU,
        rms_norm_reference,
        rotary_reference,
        swiglu_reference,
    )

    x, weight = _leaf(TOKENS, HIDDEN), _leaf(HIDDEN)
    gate, up = _leaf(TOKENS, INTERMEDIATE), _leaf(TOKENS, INTERMEDIATE)
    q, k = _leaf(1, HEADS, TOKENS, HEAD_DIM), _leaf(1, KV_HEADS, TOKENS, HEAD_DIM)
    cos, sin = torch.randn(2, 1, TOKENS, HEAD_DIM, device="cuda").to(torch.bfloat16).unbind(0)
    hidden, head = _leaf(TOKENS, HIDDEN), _leaf(VOCAB, HIDDEN, scale=HIDDEN**-0.5)
    labels = torch.randint(0, VOCAB, (TOKENS,), device="cuda")
    steps: dict[str, dict[str, Step]] = {
        "rms_norm": {
            "pytorch": lambda: _backward(rms_norm_reference(x, weight, 1e-6)),
            "twinkle": lambda: _backward(TritonRMSNorm()(x, weight, 1e-6)),
        },
        "swiglu": {
            "pytorch": lambda: _backward(swiglu_reference(gate, up)),
            "twinkle": lambda: _backward(TritonSwiGLU()(gate, up)),
        },
        "rotary": {
            "pytorch": lambda: _backward(rotary_reference(q, k, cos, sin)),
            "twinkle": lambda: _backward(TritonRotary()(q, k, cos, sin)),
        },
        "label log-probs": {
            "pytorch": lambda: _backward(torch.log_softmax((hidden @ head.T).float(), -1).gather(-1, labels[:, None])),
            "twinkle": lambda: _backward(TritonLinearLogps()(hidden, head, labels).logps),
        },
    }
    try:
        from liger_kernel.transformers import functional as liger
    except ImportError:
        return steps
    steps["rms_norm"]["liger"] = lambda: _backward(liger.liger_rms_norm(x, weight, 1e-6, in_place=False))
    steps["swiglu"]["liger"] = lambda: _backward(liger.liger_swiglu(gate, up))
    steps["rotary"]["liger"] = lambda: _backward(liger.liger_rope(q, k, cos, sin))
    steps["label log-probs"]["liger"] = lambda: _backward(
        liger.liger_fused_linear_cross_entropy(hidden, head, labels, reduction="sum")
    )
    return steps


def bench_each_kernel() -> list[dict[str, Any]]:
    """One row per op: milliseconds and peak MiB of each implementation's forward + backward."""
    rows = []
    for op, implementations in _steps().items():
        row: dict[str, Any] = {"op": op}
        for name, step in implementations.items():
            row[f"{name}_ms"] = _milliseconds(step)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        rows.append(row)
    return rows


def print_each_kernel() -> None:
    rows = bench_each_kernel()
    print(f"each kernel, forward + backward, bfloat16, {TOKENS} tokens (Qwen3-8B sizes):")
    for row in rows:
        parts = [
            f"{name:8s} {row[f'{name}_ms']:8.3f} ms {row[f'{name}_peak_mib']:9.1f} MiB"
            for name in ("pytorch", "twinkle", "liger")
            if f"{name}_ms" in row
        ]
        speedup = row["pytorch_ms"] / row["twinkle_ms"]
        versus = f", liger/twinkle time {row['liger_ms'] / row['twinkle_ms']:.2f}" if "liger_ms" in row else ""
        print(f"  {row['op']:16s} " + " | ".join(parts) + f"  (pytorch/twinkle time {speedup:.2f}{versus})")
    if not any("liger_ms" in row for row in rows):
        print("  (liger-kernel is not installed: pip install liger-kernel to time its kernels too)")
