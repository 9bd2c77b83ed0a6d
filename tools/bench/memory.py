"""Peak memory and time of a LoRA step with and without activation checkpointing, side by side in one run.

A random-weight model of Qwen3-0.6B's shape (28 layers, hidden 1,024, vocabulary 151,936, tied embeddings),
one sequence of ``--length`` (2,048) tokens, LoRA r=16 on every linear layer, AdamW. Each side is a
``TransformersModel`` (``--backend megatron``: a ``MegatronModel``) doing ``forward_backward`` +
``clip_grad_and_step``; the only difference is ``gradient_checkpointing=True``. Each side runs in a
process of its own, with glibc told to map every allocation of 128 KiB or more on its own
(``MALLOC_MMAP_THRESHOLD_``), so freed activations leave the resident set instead of staying in malloc's
heap for the next step to reuse unseen. Activation memory is
the first step's peak above what was resident before it (weights and adapter: ``peak_memory.py``; the
LoRA optimizer state it adds is a few MB); time is the median of the ``--steps`` steps after it. Target: at
least 2x less activation memory for at most 1.4x the step time.

```bash
python tools/bench/memory.py           # about 5 minutes and 12 GB on 2 CPU cores
python tools/bench/memory.py --quick   # 8 layers, 512 tokens: a smoke run
python tools/bench/memory.py --backend megatron   # the same on megatron-core (twinkle-model[megatron])
```
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig

sys.path.insert(0, str(Path(__file__).parent))
from peak_memory import peak_memory  # siblings in tools/bench, not a package
from qwen3_shape import QWEN3_06B, random_qwen3

from twinkle.model import TrainingModel, TransformersModel


def _side(path: str, backend: str, checkpointing: bool, length: int, steps: int) -> dict[str, float]:
    if backend == "megatron":
        from twinkle.model.megatron import MegatronModel  # the extra: imported only when asked for

        model: TrainingModel = MegatronModel(path, gradient_checkpointing=checkpointing)
    else:
        model = TransformersModel(path, gradient_checkpointing=checkpointing)
    model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), seed=0)
    model.set_optimizer("AdamW", lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, QWEN3_06B["vocab_size"], (length,), generator=generator).tolist()
    batch = [{"input_ids": ids, "labels": ids}]
    seconds, losses = [], []
    with peak_memory(model.device) as peak:
        losses.append(model.forward_backward(batch).loss)
        model.clip_grad_and_step()
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(model.forward_backward(batch).loss)
        model.clip_grad_and_step()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return {"seconds": statistics.median(seconds), "peak_bytes": peak.bytes, "loss": losses[0]}


def _run_side(path: str, backend: str, checkpointing: bool, length: int, steps: int) -> dict[str, float]:
    """One side in a fresh process (see the module docstring)."""
    command = [sys.executable, __file__, "--side", path, "--backend", backend]
    command += ["--length", str(length), "--steps", str(steps)]
    command += ["--checkpointing"] if checkpointing else []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {'checkpointed' if checkpointing else 'plain'} side failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 layers and 512 tokens")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the measured first one")
    parser.add_argument("--backend", choices=("transformers", "megatron"), default="transformers")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side on this model folder
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(_side(args.side, args.backend, args.checkpointing, args.length, args.steps)))
        return
    layers, length = (8, 512) if args.quick else (28, args.length)
    with tempfile.TemporaryDirectory() as folder:
        path = random_qwen3(Path(folder), layers)
        plain = _run_side(path, args.backend, False, length, args.steps)
        checkpointed = _run_side(path, args.backend, True, length, args.steps)
    print(f"LoRA step on {args.backend}, Qwen3-0.6B shape ({layers} layers), 1 × {length} tokens:")
    for name, side in (("plain", plain), ("checkpointed", checkpointed)):
        print(f"  {name:12} activation peak {side['peak_bytes'] / 2**20:9.1f} MiB  step {side['seconds']:7.2f} s")
    memory_ratio = plain["peak_bytes"] / max(checkpointed["peak_bytes"], 1)
    time_ratio = checkpointed["seconds"] / plain["seconds"]
    print(
        f"  activation memory plain/checkpointed: {memory_ratio:.2f}x (target ≥ 2); "
        f"step time checkpointed/plain: {time_ratio:.2f}x (target ≤ 1.4); "
        f"first losses {plain['loss']:.6f} vs {checkpointed['loss']:.6f}"
    )


if __name__ == "__main__":
    main()
