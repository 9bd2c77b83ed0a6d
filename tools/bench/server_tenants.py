"""Part (2) of ``server.py``: many tenants at once, native, Tinker or mixed, against the in-process limit.

Each tenant is its own client process with its own user and adapter:

- **native**: ``twinkle_client``'s ``TransformersModel``: ``forward_backward``
  then ``clip_grad_and_step``, two round trips per step;
- **tinker**: the unmodified ``tinker`` SDK: ``forward_backward`` (cross-entropy)
  and ``optim_step`` sent together, then both awaited, as Tinker recommends.

**mixed** is half native, half Tinker tenants. Tenants of both kinds train on
the same token ids (a Tinker datum is the feature's ids shifted by one, weighted
where the feature has labels), so every kind moves the same number of tokens.

The in-process limit is what the server's engine does with the same work and
no HTTP at all: one ``MultiLoraModel.forward_backward_many`` over the 8
tenants' batches (features or Tinker targets, as the tenants send them, and
LoRA on the output layer for Tinker tenants, as the SDK's default asks), then
their 8 optimizer steps, in this process. It is measured right before and right
after every batched server run at 8 tenants, and the server's throughput is
compared with the mean of those two: this machine's speed drifts by several
percent from one minute to the next, and a measurement on both sides cancels
the drift instead of catching it once in the limit and once in the server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from server_procs import MODEL_ID, Server  # a sibling (run from here)

from twinkle.data_format import IGNORE_INDEX, make_input_feature

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
SEED = 0
KINDS = ("native", "tinker", "mixed")
SERVERS = ("batched", "one-at-a-time")
READY, RESULT = "@@ready", "@@result"  # the tenant workers' stdout protocol
LIMIT_TARGET = 0.95
TINKER_RANK = 16
# What the server adapts for the SDK's default LoraConfig (train_attn, train_mlp and train_unembed all true):
# the output layer too, unlike PEFT's "all-linear".
TINKER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


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


class Tenant:
    """A client process training one adapter on one server; runs ``go N`` commands from its stdin."""

    def __init__(self, server: Server, user: str, kind: str, seed: int, args: argparse.Namespace, log: TextIO) -> None:
        self.server_name = server.name
        spec = {
            "url": server.url,
            "key": server.keys[user],
            "kind": kind,
            "seed": seed,
            "batch_size": args.tenant_batch,
            "length": args.tenant_length,
        }
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("server.py")), "--tenant-worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )

    def expect(self, prefix: str) -> str:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"a tenant worker of server {self.server_name!r} exited {self.process.wait()}")

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
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


def tinker_datum(feature: dict[str, Any]) -> Any:
    """The feature as a Tinker cross-entropy datum: ids shifted by one, weight 1 where the feature has a label."""
    from tinker import types

    ids, labels = feature["input_ids"], feature["labels"]
    weights = [0.0 if label < 0 else 1.0 for label in labels[1:]]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}
    )


def tinker_model(url: str, key: str, seed: int) -> tuple[Step, Callable[[], Any]]:
    """A Tinker tenant's step (forward_backward and optim_step sent together), and how to close its client."""
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=url, api_key=key)
    trainer = client.create_lora_training_client(base_model=MODEL_ID, rank=TINKER_RANK, seed=seed).result()
    adam = types.AdamParams(learning_rate=LEARNING_RATE, grad_clip_norm=MAX_GRAD_NORM)

    def step(batch: list[dict[str, Any]]) -> float:
        fwdbwd = trainer.forward_backward([tinker_datum(feature) for feature in batch], "cross_entropy")
        optim = trainer.optim_step(adam)
        loss = fwdbwd.result().metrics["loss:sum"]
        optim.result()
        return float(loss)

    return step, lambda: client.close("success").result(timeout=30)


def tenant_worker(spec: dict[str, Any]) -> None:
    """A tenant process: add an adapter, warm up one step, say ready, then run ``go N`` until ``quit``."""
    make = tinker_model if spec["kind"] == "tinker" else remote_model
    step, close = make(spec["url"], spec["key"], spec["seed"])
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


def tenants_of(pool: dict[str, list[Tenant]], kind: str, n: int) -> list[Tenant]:
    """``n`` tenants of ``kind``; mixed takes native and Tinker tenants in turn."""
    if kind != "mixed":
        return pool[kind][:n]
    return [pool["native" if i % 2 == 0 else "tinker"][i // 2] for i in range(n)]


def kind_of(kind: str, index: int) -> str:
    return kind if kind != "mixed" else ("native" if index % 2 == 0 else "tinker")


def many_tenants(servers: dict[str, Server], args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
    seed = SEED
    pools: dict[str, dict[str, list[Tenant]]] = {name: {"native": [], "tinker": []} for name in servers}
    with open(Path(args.workdir) / "tenants.log", "w") as log:  # each worker keeps its own copy of the file
        for name, server in servers.items():
            for kind in ("native", "tinker"):
                for index in range(max(args.tenants)):
                    tenant = Tenant(server, f"{kind}{index}", kind, seed + 1 + index, args, log)
                    stack.callback(tenant.stop)
                    pools[name][kind].append(tenant)
    for pool in pools.values():
        for tenants in pool.values():
            for tenant in tenants:
                tenant.expect(READY)

    tokens_per_step = args.tenant_batch * args.tenant_length
    keys = [(kind, n) for kind in args.kinds for n in args.tenants]
    speeds: dict[tuple[str, str, int], list[float]] = {(name, *key): [] for name in servers for key in keys}
    per_pass = {(name, *key): [0.0, 0.0] for name in servers for key in keys}
    busy: dict[tuple[str, str, int], list[float]] = {(name, *key): [] for name in servers for key in keys}
    largest = max(args.tenants)
    limits = {kind: InProcessLimit(kind, largest, args) for kind in args.kinds}
    fractions: dict[str, list[float]] = {kind: [] for kind in args.kinds}  # batched / limit, per round
    # Each kind's rounds run one after another. After the pause between two measurements, a batched server
    # expects back the runs that last shared a pass with the runs back (``expected_runs``): a measurement
    # right after other tenants trained with these waits ``cycle_wait_s`` once for them, which is a cost of
    # switching tenants (paid in each kind's first round here), not of serving them.
    for key_index, (kind, n) in enumerate(keys):
        for round_index in range(args.rounds):
            order = SERVERS if (round_index + key_index) % 2 == 0 else SERVERS[::-1]
            for name in order:
                bracketed = n == largest and name == "batched"  # the limit right before and right after
                limit_before = limits[kind].measure(args.tenant_steps) if bracketed else 0.0
                before = servers[name].counters()
                seconds = run_tenants(tenants_of(pools[name], kind, n), args.tenant_steps)
                after = servers[name].counters()
                speed = n * args.tenant_steps * tokens_per_step / seconds
                speeds[name, kind, n].append(speed)
                if bracketed:
                    fractions[kind].append(speed / ((limit_before + limits[kind].measure(args.tenant_steps)) / 2))
                per_pass[name, kind, n][0] += after[0] - before[0]
                per_pass[name, kind, n][1] += after[1] - before[1]
                busy[name, kind, n].append((after[2] - before[2]) / seconds)

    print(
        f"\n(2) aggregate training throughput, each tenant a client process with its own user and adapter, "
        f"{args.tenant_batch} x {args.tenant_length} tokens per step, {args.tenant_steps} step(s) per tenant per "
        f"measurement, median of {args.rounds} rounds (input tokens/s summed over tenants)"
    )
    print(
        f"  {'kind':>6} {'tenants':>7}  {'batched':>18}  {'one at a time':>18}  {'ratio':>5}  requests per pass  "
        "model busy (batched, one at a time)"
    )
    for kind, n in keys:
        median = {name: statistics.median(speeds[name, kind, n]) for name in servers}
        total, count = per_pass["batched", kind, n]
        single_total, single_count = per_pass["one-at-a-time", kind, n]
        if single_count and single_total != single_count:
            raise RuntimeError(f"the one-at-a-time server batched requests: {single_total} in {single_count} passes")
        mean_pass = f"{total / count:.2f}" if count else "none"
        utilisation = {name: statistics.median(busy[name, kind, n]) for name in servers}
        print(
            f"  {kind:>6} {n:>7}  {median['batched']:>8.0f} tokens/s  {median['one-at-a-time']:>8.0f} tokens/s  "
            f"{median['batched'] / median['one-at-a-time']:>5.2f}  {mean_pass:>17}  "
            f"{utilisation['batched']:>5.0%}, {utilisation['one-at-a-time']:.0%}"
        )
    print(
        f"  in-process limit at {largest} tenants: one forward_backward_many over their batches + their steps, "
        "measured right before and after each batched run (median of the rounds' ratios to their mean)"
    )
    for kind in args.kinds:
        limit = limits[kind].tokens_per_second()
        ratio = statistics.median(fractions[kind])
        verdict = "meets" if ratio >= LIMIT_TARGET else "BELOW"
        # Tokens per second of the model's busy time: the server's own work, without its waits for the tenants.
        while_busy = ratio / statistics.median(busy["batched", kind, largest])
        each = ", ".join(f"{fraction:.2f}" for fraction in fractions[kind])
        print(
            f"  {kind:>6}  limit {limit:8.0f} tokens/s; batched server {ratio:.2f}x of it "
            f"({verdict} the target >= {LIMIT_TARGET}; rounds: {each}); while the model is busy, {while_busy:.2f}x"
        )
    if not any(per_pass["batched", kind, largest][1] for kind in args.kinds):
        print("  WARNING: the batched server ran no shared pass, so it ran every call alone, like the other one.")


class InProcessLimit:
    """The server's work done in this process: one shared pass over every tenant's batch, then their steps."""

    def __init__(self, kind: str, tenants: int, args: argparse.Namespace) -> None:
        from peft import LoraConfig

        from twinkle.model import MultiLoraModel

        self.kind, self.tokens = kind, tenants * args.tenant_batch * args.tenant_length
        self.model = MultiLoraModel(MODEL_ID, max_loras=tenants)
        tinker_lora = {"r": TINKER_RANK, "lora_alpha": 32, "target_modules": TINKER_TARGETS}
        self.names = [f"t{index}" for index in range(tenants)]
        for index, name in enumerate(self.names):
            config = tinker_lora if kind_of(kind, index) == "tinker" else LORA
            self.model.add_adapter_to_model(name, LoraConfig(**config), seed=SEED + 1 + index)
            self.model.set_optimizer("AdamW", adapter_name=name, lr=LEARNING_RATE)
        # The tenants' batches: each trains on the batches of its seed, in turn.
        self.batches = [make_batches(SEED + 1 + i, 4, args.tenant_batch, args.tenant_length) for i in range(tenants)]
        self.done = 0
        self.seconds: list[float] = []
        self._step()  # warms up

    def measure(self, steps: int) -> float:
        """Tokens/s over ``steps`` more steps (all tokens over all their time, as a server run is counted)."""
        seconds = [self._step() for _ in range(steps)]
        self.seconds.extend(seconds)
        return self.tokens * steps / sum(seconds)

    def tokens_per_second(self) -> float:
        return self.tokens / statistics.median(self.seconds)

    def _step(self) -> float:
        work = self._requests(self.done)
        start = time.perf_counter()
        results = self.model.forward_backward_many(work)
        for name in self.names:
            self.model.clip_grad_and_step(MAX_GRAD_NORM, adapter_name=name)
        seconds = time.perf_counter() - start
        failed = [result.error for result in results if result.error is not None]
        if failed:
            raise RuntimeError(f"the in-process shared pass failed: {failed[0]}")
        self.done += 1
        return seconds

    def _requests(self, step: int) -> list[Any]:
        import torch

        from twinkle.model import AdapterRequest, TargetSequence, TargetsRequest

        made: list[Any] = []
        for index, name in enumerate(self.names):
            batch = self.batches[index][step % 4]
            if kind_of(self.kind, index) == "native":
                made.append(AdapterRequest(name, batch))
                continue
            datums = [tinker_datum(feature) for feature in batch]
            sequences = [
                TargetSequence(torch.tensor(feature["input_ids"][:-1]), torch.tensor(feature["input_ids"][1:]))
                for feature in batch
            ]
            weights = [torch.tensor(d.loss_fn_inputs["weights"].tolist()) for d in datums]
            made.append(TargetsRequest(name, sequences, _cross_entropy(weights)))
        return made


def _cross_entropy(weights: list[Any]) -> Any:
    def loss_fn(logps: list[Any]) -> tuple[Any, dict[str, float]]:
        loss = -sum((lp * w).sum() for lp, w in zip(logps, weights, strict=True))
        return loss, {}

    return loss_fn
