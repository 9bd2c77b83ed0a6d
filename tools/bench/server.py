"""What training through ``twinkle server`` costs, and what its multi-tenant batching buys.

A tenant of a Twinkle server trains with ``twinkle_client`` exactly as it would
in-process: ``TransformersModel().add_adapter_to_model(...)``, then
``forward_backward`` and ``clip_grad_and_step`` in a loop. Each call becomes an
HTTP request, a future in the server's SQLite store, a job in its scheduler and
a long-poll for the result. This script measures two things, with real
``twinkle server`` processes started here (``python -m twinkle.cli server``,
bound to 127.0.0.1 on a free port; the script checks with ``ss -tnlp`` that they
listen there only, and stops them at the end whatever happens):

(1) **Overhead of the server on one tenant.** The same LoRA SFT step
    (``--batch-size`` x ``--length`` tokens, labels on the second half of each
    sequence) run three ways, side by side on the same batches:

    - **remote**: ``twinkle_client.model.TransformersModel`` -> the server;
    - **MultiLoraModel**: ``twinkle.model.MultiLoraModel`` in this process, the
      engine the server runs (so remote / MultiLoraModel is the cost of HTTP,
      futures and scheduling; the target is an overhead of 10% or less);
    - **TransformersModel**: ``twinkle.model.TransformersModel`` in this process,
      the single-tenant engine (PEFT's LoRA layers).

(2) **Aggregate throughput with 1, 4 and 8 tenants.** Each tenant is its own
    client process (``twinkle_client`` only, no torch) with its own user, API
    key and adapter, running ``--tenant-steps`` steps of ``forward_backward`` +
    ``clip_grad_and_step`` on ``--tenant-batch`` x ``--tenant-length`` tokens,
    all tenants at once. Tokens/s is summed over tenants: every tenant's input
    tokens divided by the wall time from the start signal until the last tenant
    is done. Two servers run the same tenants:

    - **batched**: the default scheduler, which trains the tenants' pending
      ``forward_backward`` calls together in one shared pass
      (``MultiLoraModel.forward_backward_many``);
    - **one at a time**: a server with ``max_tokens_per_pass: 0`` in its
      config, whose scheduler gives every pass one request.

    The scheduler never waits for a pass to fill: a call arriving at an idle
    server runs at once, and the calls that arrive meanwhile share the next
    pass. So the requests per pass (printed) are fewer than the tenants.

    The script warns when the batched server ran no shared pass (its
    ``/metrics``), which would mean tenants' calls were kept apart.

How it stays fair:

- Every side trains the embedded ``builtin://qwen3-tiny`` (float32, sdpa) with
  LoRA r=16, alpha 32, all linear layers, no dropout, the same adapter seed,
  AdamW (lr 1e-4) and clipping at 1.0, on the same batches in the same order.
  In (1) the remote and in-process MultiLoraModel sides compute the same
  losses; the script prints the largest difference as evidence.
- Both servers have the same config apart from ``max_tokens_per_pass``, the same
  number of resident adapters and the same tenants; in (2) single-tenant passes
  go through ``forward_backward_many`` on both. The script reads each server's
  ``/metrics`` and prints how many requests its passes actually held.
- Warm-up steps are not timed. In (1) the sides take turns step by step, the
  order rotating, and the median step is reported (also the median of the
  per-step ratios, which pairs steps run seconds apart). In (2) the servers
  take turns measurement by measurement, the first one alternating, and the
  median over ``--rounds`` is reported.
- Threads: the server and this process share the machine's cores (two here).
  In (1) they never compute at the same time (the client waits for its reply),
  so both get ``--threads`` torch threads, by default every core
  (``torch.set_num_threads`` here, ``OMP_NUM_THREADS`` for the servers): fewer
  would only slow whichever side is computing. The tenant processes hardly use
  the CPU (encoding a batch, HTTP); what they use is part of the cost measured.

Run it from the repository root:

    python tools/bench/server.py                  # the full benchmark (about 2.5 minutes on 2 idle CPU cores)
    python tools/bench/server.py --quick          # a smoke run, about 40 s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from server_procs import MODEL_ID, Server, started_servers  # a sibling (run from here)

from twinkle.data_format import IGNORE_INDEX, make_input_feature

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
SEED = 0
OVERHEAD_TARGET = 0.10
SIDES = ("remote", "multilora", "transformers")
LABELS = {"remote": "remote (client->server)", "multilora": "MultiLoraModel", "transformers": "TransformersModel"}
SERVERS = ("batched", "one-at-a-time")
READY, RESULT = "@@ready", "@@result"  # the tenant workers' stdout protocol

Batch = list[dict[str, Any]]
Step = Callable[[Batch], float]  # one training step; returns the loss


def make_batches(seed: int, count: int, batch_size: int, length: int) -> list[Batch]:
    """``count`` batches of random token ids, labels on the second half of every sequence."""
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        batch = []
        for _ in range(batch_size):
            ids = [rng.randrange(100, 150_000) for _ in range(length)]
            batch.append(make_input_feature(ids, [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]))
        batches.append(batch)
    return batches


# ---------------------------------------------------------------------------- (1) one tenant


def remote_model(url: str, key: str, seed: int) -> tuple[Step, Callable[[], None]]:
    """A tenant's step through ``twinkle_client``, and how to close its session (which frees the adapter)."""
    from twinkle_client import LoraConfig, init_twinkle_client
    from twinkle_client.model import TransformersModel as RemoteModel

    client = init_twinkle_client(url, key)
    model = RemoteModel()
    model.add_adapter_to_model("bench", LoraConfig(**LORA), seed=seed)
    model.set_optimizer("AdamW", lr=LEARNING_RATE)

    def step(batch: Batch) -> float:
        loss = model.forward_backward(batch).loss
        model.clip_grad_and_step(MAX_GRAD_NORM)
        return float(loss)

    return step, client.close


def local_step(kind: str) -> Step:
    """The same step on an in-process ``MultiLoraModel`` (the server's engine) or ``TransformersModel``."""
    import torch
    from peft import LoraConfig

    from twinkle.model import MultiLoraModel, TransformersModel

    # The default device, as the server's pool has: a GPU if there is one.
    model = MultiLoraModel(MODEL_ID) if kind == "multilora" else TransformersModel(MODEL_ID)
    model.add_adapter_to_model("bench", LoraConfig(**LORA), seed=SEED)
    model.set_optimizer("AdamW", adapter_name="bench", lr=LEARNING_RATE)
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    def step(batch: Batch) -> float:
        loss = model.forward_backward(batch, adapter_name="bench").loss
        model.clip_grad_and_step(MAX_GRAD_NORM, adapter_name="bench")
        synchronize()  # the remote side's reply comes once the step is done
        return float(loss)

    return step


def one_tenant(server: Server, args: argparse.Namespace) -> None:
    remote, close = remote_model(server.url, server.keys["bench"], SEED)
    try:
        steps = {"remote": remote, "multilora": local_step("multilora"), "transformers": local_step("transformers")}
        batches = make_batches(SEED, args.steps, args.batch_size, args.length)
        seconds: dict[str, list[float]] = {side: [] for side in SIDES}
        losses: dict[str, list[float]] = {side: [] for side in SIDES}
        for index in range(args.warmup + args.steps):
            batch = batches[index % len(batches)]
            order = SIDES[index % 3 :] + SIDES[: index % 3]
            for side in order:
                start = time.perf_counter()
                losses[side].append(steps[side](batch))
                if index >= args.warmup:
                    seconds[side].append(time.perf_counter() - start)
    finally:
        close()  # the remote adapter leaves the server's pool, as the tenants in (2) need the slots

    print(
        f"\n(1) one tenant, {args.batch_size} x {args.length} tokens per step (labels on the second half): "
        f"{args.warmup} warm-up step(s), then {args.steps} timed steps per side, taking turns"
    )
    median = {side: statistics.median(values) for side, values in seconds.items()}
    for side in SIDES:
        each = ", ".join(f"{value:.2f}" for value in seconds[side])
        tokens = args.batch_size * args.length / median[side]
        print(f"  {LABELS[side]:<24} {median[side]:7.3f} s/step  {tokens:7.0f} tokens/s   (steps: {each})")
    for baseline in ("multilora", "transformers"):
        overhead = median["remote"] / median[baseline] - 1
        paired = statistics.median(r / b for r, b in zip(seconds["remote"], seconds[baseline], strict=True)) - 1
        verdict = ("meets" if overhead <= OVERHEAD_TARGET else "ABOVE") if baseline == "multilora" else "vs"
        target = f"the target <= {OVERHEAD_TARGET:.0%}" if baseline == "multilora" else "the single-tenant engine"
        print(
            f"  server overhead vs {LABELS[baseline]:<18} {overhead:+6.1%}   ({verdict} {target}; "
            f"median of per-step ratios {paired:+.1%})"
        )
    gap = max(abs(a - b) for a, b in zip(losses["remote"], losses["multilora"], strict=True))
    count = len(losses["remote"])
    print(f"  same losses remote and in-process MultiLoraModel: max |diff| {gap:.1e} over {count} steps")


# ---------------------------------------------------------------------------- (2) many tenants


class Tenant:
    """A client process training one adapter on one server; runs ``go N`` commands from its stdin."""

    def __init__(self, server: Server, user: str, seed: int, args: argparse.Namespace, log: TextIO) -> None:
        self.server_name = server.name
        spec = {
            "url": server.url,
            "key": server.keys[user],
            "seed": seed,
            "batch_size": args.tenant_batch,
            "length": args.tenant_length,
        }
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--tenant-worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )

    def expect(self, prefix: str) -> str:
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"a tenant worker of server {self.server_name!r} exited {self.process.wait()}")

    def send(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(OSError):
                self.send("quit")
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def tenant_worker(spec: dict[str, Any]) -> None:
    """A tenant process: add an adapter, warm up one step, say ready, then run ``go N`` until ``quit``."""
    step, close = remote_model(spec["url"], spec["key"], spec["seed"])
    batches = make_batches(spec["seed"], 4, spec["batch_size"], spec["length"])
    step(batches[-1])
    print(READY, flush=True)
    done = 0
    for line in sys.stdin:
        command = line.split()
        if command[:1] != ["go"]:
            break
        for _ in range(int(command[1])):
            step(batches[done % len(batches)])
            done += 1
        print(RESULT, done, flush=True)
    close()


def run_tenants(tenants: list[Tenant], steps: int) -> float:
    """Seconds until every tenant has run ``steps`` steps, all started together."""
    start = time.perf_counter()
    for tenant in tenants:
        tenant.send(f"go {steps}")
    for tenant in tenants:
        tenant.expect(RESULT)
    return time.perf_counter() - start


def many_tenants(servers: dict[str, Server], args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    pool: dict[str, list[Tenant]] = {name: [] for name in servers}
    with open(Path(args.workdir) / "tenants.log", "w") as log:  # each worker keeps its own copy of the file
        for name, server in servers.items():
            for index in range(max(args.tenants)):
                tenant = Tenant(server, f"tenant{index}", SEED + 1 + index, args, log)
                stack.callback(tenant.stop)
                pool[name].append(tenant)
    for tenants in pool.values():
        for tenant in tenants:
            tenant.expect(READY)

    tokens_per_step = args.tenant_batch * args.tenant_length
    speeds = {(name, n): [] for name in servers for n in args.tenants}
    per_pass = {(name, n): [0.0, 0.0] for name in servers for n in args.tenants}
    for round_index in range(args.rounds):
        for n_index, n in enumerate(args.tenants):
            order = SERVERS if (round_index + n_index) % 2 == 0 else SERVERS[::-1]
            for name in order:
                before = servers[name].pass_sizes()
                seconds = run_tenants(pool[name][:n], args.tenant_steps)
                after = servers[name].pass_sizes()
                speeds[name, n].append(n * args.tenant_steps * tokens_per_step / seconds)
                per_pass[name, n][0] += after[0] - before[0]
                per_pass[name, n][1] += after[1] - before[1]

    print(
        f"\n(2) aggregate training throughput, each tenant a client process with its own user and adapter, "
        f"{args.tenant_batch} x {args.tenant_length} tokens per step, {args.tenant_steps} step(s) per tenant per "
        f"measurement, median of {args.rounds} rounds (input tokens/s summed over tenants)"
    )
    print(f"  {'tenants':>7}  {'batched':>18}  {'one at a time':>18}  {'ratio':>5}  requests per pass (batched)")
    for n in args.tenants:
        median = {name: statistics.median(speeds[name, n]) for name in servers}
        total, count = per_pass["batched", n]
        single_total, single_count = per_pass["one-at-a-time", n]
        if single_count and single_total != single_count:
            raise RuntimeError(f"the one-at-a-time server batched requests: {single_total} in {single_count} passes")
        rounds = {name: "/".join(f"{value:.0f}" for value in speeds[name, n]) for name in servers}
        mean_pass = f"{total / count:.2f}" if count else "none"
        print(
            f"  {n:>7}  {median['batched']:>8.0f} tokens/s  {median['one-at-a-time']:>8.0f} tokens/s  "
            f"{median['batched'] / median['one-at-a-time']:>5.2f}  {mean_pass:>5}"
            f"   (rounds: {rounds['batched']} vs {rounds['one-at-a-time']})"
        )
    if not per_pass["batched", max(args.tenants)][1]:
        print("  WARNING: the batched server ran no shared pass, so it ran every call alone, like the other one.")


# ---------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step in (1)")
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence in (1)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side in (1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first in (1)")
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 4, 8], help="tenant counts in (2); at most 8")
    parser.add_argument("--tenant-batch", type=int, default=2, help="sequences per tenant step in (2)")
    parser.add_argument("--tenant-length", type=int, default=128, help="tokens per sequence in (2)")
    parser.add_argument("--tenant-steps", type=int, default=3, help="steps per tenant per measurement in (2)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per server and tenant count in (2)")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads here and in each server (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: short sequences, 1 round, 1 step")
    parser.add_argument("--tenant-worker", help=argparse.SUPPRESS)  # internal: run as a tenant process
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.length, args.steps, args.warmup = 4, 64, 2, 1
        args.tenant_length, args.tenant_steps, args.rounds = 32, 1, 1
    if not 1 <= max(args.tenants) <= 8 or min(args.tenants) < 1:  # a server holds 8 adapters by default
        parser.error("--tenants must be between 1 and 8")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tenant_worker:
        tenant_worker(json.loads(args.tenant_worker))
        return
    import torch  # here, not at the top: the tenant workers run this file without torch
    from transformers.utils.logging import disable_progress_bar

    torch.set_num_threads(args.threads)
    disable_progress_bar()  # weight-loading bars would interleave with the results
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # raised inside PEFT, not ours
    calls = "TransformersModel.forward_backward"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"model {MODEL_ID} on {device} (float32, {args.threads} torch threads here and in each server, "
        f"{os.cpu_count()} cores), LoRA r=16 all-linear; remote forward_backward via {calls}; "
        f"load average {os.getloadavg()[0]:.1f} (other processes make the absolute numbers noisy)"
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-server-") as root, contextlib.ExitStack() as stack:
        args.workdir = root
        servers = stack.enter_context(started_servers(Path(root), args))
        one_tenant(servers["batched"], args)
        many_tenants(servers, args, stack)
    print(f"\ndone in {time.monotonic() - started:.0f} s; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
