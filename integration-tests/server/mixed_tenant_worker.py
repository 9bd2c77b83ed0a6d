"""One tenant of the mixed Tinker + native test, run as its own process: ``mixed_tenant_worker.py USER URL KEY``.

A Tinker tenant (``sft``, ``is``, ``ppo``) trains with the unmodified tinker SDK, a native one (``nat1``,
``nat2``) with ``twinkle_client``; the process prints one ``RESULT`` line of JSON: the losses, the
log-probs (Tinker) and where its final checkpoint is, relative to the server's checkpoint folder.
The jobs' data is defined here, for the test's in-process references too.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
from tinker import types

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from harness import batch, new_run
from tinker_harness import BASE_MODEL, close_clients, logprobs_of, rl_datum, service_client, sft_datum

from twinkle_client.http import TwinkleClient

RESULT = "RESULT "
STEPS = 3
RANK = 2
TINKER_LR = 5e-3
TINKER_JOBS = {"sft": ("cross_entropy", 31), "is": ("importance_sampling", 32), "ppo": ("ppo", 33)}
NATIVE_JOBS = {"nat1": 41, "nat2": 42}


def tinker_data(user: str, step: int, current: list[np.ndarray] | None) -> list[types.Datum]:
    """Two datums per step; the RL ones carry sampler log-probs near the current ones (ratios around 1 ± 0.4)."""
    seeds = _seeds(user, step)
    if user == "sft":
        return [sft_datum(seeds[0]), sft_datum(seeds[1], length=7)]
    assert current is not None
    data = []
    for i, (seed, logps) in enumerate(zip(seeds, current, strict=True)):
        n = len(logps)
        offsets = np.linspace(-0.4, 0.4, n) * (1 if i == 0 else -1)  # ppo clips the ratios beyond 0.8 / 1.2
        advantages = np.where(np.arange(n) % 2 == 0, 1.0, -0.5)
        data.append(rl_datum(seed, list(logps + offsets), list(advantages)))
    return data


def probe_data(user: str, step: int) -> list[types.Datum]:
    """The RL datums' tokens, for the log-probs their sampler log-probs are made from."""
    return [sft_datum(seed) for seed in _seeds(user, step)]


def native_batches(user: str) -> list[list[dict[str, Any]]]:
    return [batch(user, step, samples=2, length=6 + step) for step in range(STEPS)]


def _seeds(user: str, step: int) -> list[int]:
    return [1000 * list(TINKER_JOBS).index(user) + 10 * step + i for i in range(2)]


def tinker_tenant(url: str, key: str, user: str) -> dict[str, Any]:
    loss_fn, seed = TINKER_JOBS[user]
    client = service_client(SimpleNamespace(url=url, keys={user: key}), user)
    try:
        trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=seed).result()
        losses, logps = [], []
        for step in range(STEPS):
            current = None
            if user != "sft":
                current = logprobs_of(trainer.forward(probe_data(user, step), "cross_entropy").result())
            output = trainer.forward_backward(tinker_data(user, step, current), loss_fn).result()
            trainer.optim_step(types.AdamParams(learning_rate=TINKER_LR)).result()
            losses.append(output.metrics["loss:sum"])
            logps.extend(logprobs_of(output))
        path = trainer.save_state(f"{user}-final").result().path
    finally:
        close_clients()
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    checkpoint = [parsed.training_run_id, parsed.checkpoint_id.split("/", 1)[1]]
    return {"losses": losses, "logps": [lp.tolist() for lp in logps], "checkpoint": checkpoint}


def native_tenant(url: str, key: str, user: str) -> dict[str, Any]:
    with TwinkleClient(url, key) as client:
        run_id = new_run(client, NATIVE_JOBS[user])
        losses = []
        for inputs in native_batches(user):
            losses.append(client.call(run_id, "forward_backward", inputs=inputs)["loss"])
            client.call(run_id, "clip_grad_and_step")
        client.call(run_id, "save", name="final", save_optimizer=False)
    return {"losses": losses, "checkpoint": [run_id, "final"]}


if __name__ == "__main__":
    user, url, key = sys.argv[1:4]
    result = tinker_tenant(url, key, user) if user in TINKER_JOBS else native_tenant(url, key, user)
    print(RESULT + json.dumps(result), flush=True)
