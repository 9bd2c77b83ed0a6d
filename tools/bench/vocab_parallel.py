"""Tensor-parallel log-probs: from each rank's vocabulary slice against gathering the logits whole, side by side.

Under ``tp_size=2`` each rank of ``MegatronModel`` holds half of the output layer's vocabulary rows. What it
computes now (``twinkle.model.megatron.head.vocab_parallel_logps``): the targets' log-probs from its own
``[tokens, V/2]`` logits, the ranks exchanging a few numbers per token. What it replaces (written out here as
the baseline): gather the ``[tokens, V]`` logits on every rank, then ``log_softmax``. Both run forward and
backward on the same ``--tokens`` hidden states (hidden 1,024, vocabulary 151,936: Qwen3-0.6B's), in chunks of
``--chunk`` tokens recomputed in backward, as the pass engine runs them, under ``torchrun --nproc_per_node 2``
(one thread each, gloo). Each rank reports its median time of ``--repeats`` runs and the peak memory of the
first above what was resident before (``peak_memory.py``); the two must agree on log-probs and gradients.

```bash
python tools/bench/vocab_parallel.py           # 4,096 tokens in one chunk; about 4 minutes on 2 CPU cores
python tools/bench/vocab_parallel.py --quick   # 1,024 tokens
```
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import peak_memory  # siblings in tools/bench, not a package
from qwen3_shape import QWEN3_06B

HIDDEN, VOCAB = QWEN3_06B["hidden_size"], QWEN3_06B["vocab_size"]

Method = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sliced(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, targets_C1: torch.Tensor) -> torch.Tensor:
    from twinkle.model.megatron.collectives import copy_to_group
    from twinkle.model.megatron.head import vocab_parallel_logps

    rank, size = dist.get_rank(), dist.get_world_size()
    local_CV = torch.nn.functional.linear(copy_to_group(hidden_CH, None, size), weight_VH)
    logps_C1, _ = vocab_parallel_logps(local_CV, targets_C1, rank * local_CV.shape[-1], None, size)
    return logps_C1


def _gathered(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, targets_C1: torch.Tensor) -> torch.Tensor:
    from twinkle.model.megatron.collectives import copy_to_group, gather_last_dim

    rank, size = dist.get_rank(), dist.get_world_size()
    local_CV = torch.nn.functional.linear(copy_to_group(hidden_CH, None, size), weight_VH)
    logits_CV = gather_last_dim(local_CV, None, rank, size)
    return logits_CV.log_softmax(dim=-1).gather(-1, targets_C1)


def _step(method: Method, hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N1: torch.Tensor, chunk: int):
    """Forward and backward of the summed log-probs, chunk by chunk (each recomputed in backward)."""
    hidden_NH = hidden_NH.detach().requires_grad_()
    weight_VH = weight_VH.detach().requires_grad_()
    parts = [
        checkpoint(
            method, hidden_NH[start : start + chunk], weight_VH, targets_N1[start : start + chunk], use_reentrant=False
        )
        for start in range(0, hidden_NH.shape[0], chunk)
    ]
    logps_N1 = torch.cat(parts)
    logps_N1.sum().backward()
    return logps_N1.detach(), hidden_NH.grad, weight_VH.grad


def _worker(tokens: int, chunk: int, repeats: int) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    hidden_NH = torch.randn(tokens, HIDDEN, generator=generator)
    weight_VH = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02).chunk(size)[rank].clone()
    targets_N1 = torch.randint(0, VOCAB, (tokens, 1), generator=generator)
    result: dict[str, dict[str, float]] = {}
    outputs = {}
    for name, method in (("gathered", _gathered), ("sliced", _sliced)):
        with peak_memory(torch.device("cpu")) as peak:
            outputs[name] = _step(method, hidden_NH, weight_VH, targets_N1, chunk)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            _step(method, hidden_NH, weight_VH, targets_N1, chunk)
            seconds.append(time.perf_counter() - start)
        result[name] = {"seconds": statistics.median(seconds), "peak_bytes": peak.bytes}
    difference = max(
        float((a - b).abs().max()) for a, b in zip(*outputs.values(), strict=True) if a is not None and b is not None
    )
    if rank == 0:
        print("RESULT " + json.dumps({**result, "difference": difference}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 tokens")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=4096, help="tokens per chunk (TrainingModel's logps_chunk_size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one rank
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.chunk = 1024, 512
    if args.worker:
        _worker(args.tokens, args.chunk, args.repeats)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={port}", __file__, "--worker", "--tokens", str(args.tokens)]
    command += ["--chunk", str(args.chunk), "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the run failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(
        f"Output-layer log-probs at tp_size=2 (2 processes, one thread each), {args.tokens} tokens in chunks of "
        f"{args.chunk}, hidden {HIDDEN}, vocabulary {VOCAB}, forward + backward (rank 0):"
    )
    for name in ("gathered", "sliced"):
        side = result[name]
        print(f"  {name:9} {side['seconds']:7.2f} s  peak {side['peak_bytes'] / 2**20:8.1f} MiB")
    gathered, sliced = result["gathered"], result["sliced"]
    print(
        f"  sliced vs gathered: {gathered['seconds'] / sliced['seconds']:.2f}x faster, "
        f"{gathered['peak_bytes'] / max(sliced['peak_bytes'], 1):.2f}x less memory; "
        f"largest difference in log-probs and gradients {result['difference']:.2e}"
    )


if __name__ == "__main__":
    main()
