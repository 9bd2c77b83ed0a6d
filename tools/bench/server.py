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

(2) **Aggregate throughput with 1, 4 and 8 tenants**, native, Tinker and mixed
    (see ``server_tenants.py``). Each tenant is its own client process with its
    own user, API key and adapter, running ``--tenant-steps`` steps on
    ``--tenant-batch`` x ``--tenant-length`` tokens, all tenants at once: a
    native tenant ``forward_backward`` + ``clip_grad_and_step`` through
    ``twinkle_client``, a Tinker tenant ``forward_backward`` (cross-entropy) +
    ``optim_step`` through the unmodified ``tinker`` SDK. Tokens/s is summed over
    tenants: every tenant's input tokens divided by the wall time from the start
    signal until the last tenant is done. Two servers run the same tenants:

    - **batched**: the default scheduler, which trains the tenants' pending
      training calls together in one shared pass per clock cycle
      (``MultiLoraModel.forward_backward_many``), then runs their optimizer steps;
    - **one at a time**: a server with ``max_tokens_per_pass: 0`` in its
      config, whose scheduler gives every pass one request.

    The requests per pass are read from each server's ``/metrics``. The
    **in-process limit** is the same work without a server: one
    ``forward_backward_many`` over the 8 tenants' batches plus their 8
    optimizer steps, in this process, measured right before and right after
    each batched run at 8 tenants; that run's throughput is printed as a
    fraction of the two measurements' mean (the median over the rounds;
    target: at least 0.95).

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

    python tools/bench/server.py                  # the full benchmark (several minutes on 2 idle CPU cores)
    python tools/bench/server.py --quick          # a smoke run, about 40 s
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from server_procs import MODEL_ID, Server, started_servers  # siblings (run from here)
from server_tenants import (
    KINDS,
    LEARNING_RATE,
    LORA,
    MAX_GRAD_NORM,
    SEED,
    Batch,
    Step,
    make_batches,
    many_tenants,
    remote_model,
    tenant_worker,
)

OVERHEAD_TARGET = 0.10
SIDES = ("remote", "multilora", "transformers")
LABELS = {"remote": "remote (client->server)", "multilora": "MultiLoraModel", "transformers": "TransformersModel"}


# ---------------------------------------------------------------------------- (1) one tenant


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


# ---------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step in (1)")
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence in (1)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per side in (1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first in (1)")
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 4, 8], help="tenant counts in (2); at most 8")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="tenant kinds in (2)")
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
