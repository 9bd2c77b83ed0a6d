"""Peak memory and time of label log-probabilities through the output layer, forward and backward.

Two ways to get ``logps_N = log_softmax(hidden_NH @ weight_VH.T)[labels_N]``
and the gradients of hidden and weight from ``logps_N.sum()``:

- **plain**: full logits, ``log_softmax`` (in float32), ``gather``; autograd
  keeps ``[N, V]`` logits and their log-softmax, and the backward makes an
  ``[N, V]`` gradient.
- **twinkle**: on CUDA the Triton kernel (``TritonLinearLogps``, bfloat16
  inputs); on CPU ``twinkle.module.chunked_token_logps`` (float32), the path
  the model takes there, over ``chunk_size`` tokens at a time (a model's
  ``logps_chunk_size``). It keeps the probabilities for the backward when they
  fit in 4 GiB, which they do below about 7,000 tokens at this vocabulary: then
  it trades memory for a backward without recomputation.

Memory is the peak above what was in use just before the call (the inputs),
over forward and backward (``peak_memory.py``), so it counts the gradients of
hidden and weight on both sides; a warm-up run first absorbs one-off costs
(thread pools, kernel compilation). Time is the median of
``repeats`` runs after that warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from peak_memory import peak_memory  # a sibling in tools/bench, not a package

__all__ = ["bench_linear_logps"]

LogpsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _plain_logps(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    log_probs_NV = torch.log_softmax((hidden_NH @ weight_VH.T).float(), dim=-1)
    return log_probs_NV.gather(-1, labels_N.unsqueeze(-1)).squeeze(-1)


def _twinkle_logps(device: torch.device, chunk_size: int) -> tuple[str, LogpsFn]:
    if device.type == "cuda":
        from twinkle.kernel.linear_logps import TritonLinearLogps

        kernel = TritonLinearLogps()
        reason = kernel.unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"the Triton kernel cannot run here: {reason}")
        return "TritonLinearLogps", lambda hidden, weight, labels: kernel(hidden, weight, labels).logps
    from twinkle.module import chunked_token_logps

    return (
        f"chunked_token_logps, chunk_size={chunk_size}",
        lambda hidden, weight, labels: chunked_token_logps(hidden, weight, labels, chunk_size).logps,
    )


def _run(fn: LogpsFn, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[float, int, torch.Tensor]:
    """Seconds and peak bytes of one forward + backward, and the log-probs."""
    hidden_NH, weight_VH, _ = inputs
    hidden_NH.grad = weight_VH.grad = None
    with peak_memory(hidden_NH.device) as peak:
        start = time.perf_counter()
        logps_N = fn(*inputs)
        logps_N.sum().backward()
    seconds = time.perf_counter() - start
    return seconds, peak.bytes, logps_N.detach()


def _measure(fn: LogpsFn, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], repeats: int) -> dict[str, Any]:
    _, _, logps_N = _run(fn, inputs)  # warm-up
    runs = [_run(fn, inputs) for _ in range(repeats)]
    return {
        "seconds": statistics.median(seconds for seconds, _, _ in runs),
        "peak_bytes": max(peak for _, peak, _ in runs),
        "logps": logps_N,
    }


def bench_linear_logps(
    n_tokens: int, vocab: int, hidden: int, device: str, *, chunk_size: int = 1024, repeats: int = 3
) -> dict[str, Any]:
    """Time and peak memory of forward + backward, plain vs Twinkle, on ``device`` (``"cpu"`` or ``"cuda"``).

    Returns the sizes, ``dtype``, ``logits_bytes`` (float32 ``[N, V]``, for scale),
    ``plain`` and ``twinkle`` as ``{"seconds", "peak_bytes"}`` (``twinkle`` also
    names its ``impl``) and ``max_logps_diff`` between the two.
    """
    torch_device = torch.device(device)
    dtype = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    hidden_NH = torch.randn(n_tokens, hidden, generator=generator).to(torch_device, dtype).requires_grad_()
    weight_VH = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(torch_device, dtype)
    weight_VH.requires_grad_()
    labels_N = torch.randint(0, vocab, (n_tokens,), generator=generator).to(torch_device)
    inputs = (hidden_NH, weight_VH, labels_N)
    impl, twinkle_fn = _twinkle_logps(torch_device, chunk_size)
    plain = _measure(_plain_logps, inputs, repeats)
    twinkle = _measure(twinkle_fn, inputs, repeats)
    max_diff = (plain.pop("logps") - twinkle.pop("logps")).abs().max().item()
    return {
        "device": str(torch_device),
        "dtype": str(dtype).removeprefix("torch."),
        "n_tokens": n_tokens,
        "vocab": vocab,
        "hidden": hidden,
        "logits_bytes": n_tokens * vocab * 4,
        "plain": plain,
        "twinkle": {"impl": impl, **twinkle},
        "max_logps_diff": max_diff,
    }
