"""Pipeline parallelism: the one-forward-one-backward schedule against micro-batches one at a time, side by side.

``MegatronModel`` with ``pp_size=2`` under ``torchrun --nproc_per_node 2`` (one thread per process, the two
stages on the two cores), LoRA r=16 on every linear layer, AdamW, ``forward_backward(micro_batch_size=1)`` +
``clip_grad_and_step`` on ``--micro-batches`` sequences of ``--length`` tokens. The two runs differ only in
``pipeline_schedule``: ``"sequential"`` sends each micro-batch through both stages and back before the next
one starts; ``"1f1b"`` (the default) lets the first stage run its layers on the next micro-batch while the
second is busy with this one. The model is a random-weight Qwen3 of ``--layers`` layers (hidden 1,024,
vocabulary 151,936, Qwen3-0.6B's widths), float32. Time: the median of the ``--steps`` steps after the first;
the losses of both runs must be equal (the schedule changes when work is done, not what is computed).

```bash
python tools/bench/pipeline.py           # about 8 minutes on 2 idle CPU cores
python tools/bench/pipeline.py --quick   # 4 layers, 4 micro-batches of 64 tokens: a smoke run
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
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from qwen3_shape import QWEN3_06B, random_qwen3  # a sibling in tools/bench, not a package

SCHEDULES = ("sequential", "1f1b")


def _worker(path: str, schedule: str, micro_batches: int, length: int, steps: int) -> None:
    """One rank of a ``pp_size=2`` run (under torchrun); rank 0 prints the result as JSON."""
    from peft import LoraConfig

    import twinkle
    from twinkle import DeviceMesh
    from twinkle.model.megatron import MegatronModel

    twinkle.initialize(seed=0)
    mesh = DeviceMesh.from_sizes(world_size=2, pp_size=2)
    model = MegatronModel(path, device="cpu", device_mesh=mesh, pipeline_schedule=schedule)
    model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), seed=0)
    model.set_optimizer("AdamW", lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    batch = []
    for _ in range(micro_batches):
        ids = torch.randint(0, QWEN3_06B["vocab_size"], (length,), generator=generator).tolist()
        batch.append({"input_ids": ids, "labels": ids})
    seconds, losses = [], []
    for _ in range(steps + 1):  # the first step warms up (allocations, gloo's connections)
        start = time.perf_counter()
        losses.append(model.forward_backward(inputs=batch, micro_batch_size=1).loss)
        model.clip_grad_and_step()
        seconds.append(time.perf_counter() - start)
    if int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps({"seconds": statistics.median(seconds[1:]), "losses": losses}), flush=True)


def _run(path: str, schedule: str, args: argparse.Namespace) -> dict[str, object]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={port}", __file__, "--worker", path, "--schedule", schedule]
    command += ["--micro-batches", str(args.micro_batches), "--length", str(args.length), "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {schedule} run failed:\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, 4 micro-batches of 64 tokens")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--length", type=int, default=256, help="tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the first")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one rank on this model folder
    parser.add_argument("--schedule", choices=SCHEDULES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.micro_batches, args.length = 4, 4, 64
    if args.worker:
        _worker(args.worker, args.schedule, args.micro_batches, args.length, args.steps)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = random_qwen3(Path(folder), args.layers)
        results = {schedule: _run(path, schedule, args) for schedule in SCHEDULES}
    sequential, overlapped = results["sequential"], results["1f1b"]
    print(
        f"MegatronModel pp_size=2 on 2 processes, LoRA step, Qwen3-0.6B widths ({args.layers} layers), "
        f"{args.micro_batches} micro-batches × {args.length} tokens:"
    )
    for schedule, result in results.items():
        print(f"  {schedule:10} step {result['seconds']:7.2f} s  losses {result['losses']}")
    ratio = float(sequential["seconds"]) / float(overlapped["seconds"])  # type: ignore[arg-type]
    same = sequential["losses"] == overlapped["losses"]
    print(f"  speed-up 1f1b/sequential: {ratio:.2f}x; losses {'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
