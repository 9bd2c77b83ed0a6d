"""Tinker and native tenants train at once on one server, in the same shared passes, each as if alone.

Three tinker SDK clients (cross-entropy SFT, ``importance_sampling`` RL and
``ppo`` with clipping in play) and two native ``twinkle_client`` clients train
together. Every tenant's losses, log-probs and saved adapter must equal its
solo in-process run (float32, 1e-5): the reference is a plain
``MultiLoraModel`` with the loss written out here in torch. ``/metrics`` must
show Tinker calls trained in passes together with other tenants' calls.
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from tinker import types

from twinkle.model import MultiLoraModel, TargetSequence
from twinkle_client.http import TwinkleClient

sys.path.insert(0, str(Path(__file__).parent))
from harness import SoloReference, batch, new_run
from tinker_harness import BASE_MODEL, close_clients, logprobs_of, rl_datum, service_client, sft_datum

pytestmark = pytest.mark.integration

STEPS = 3
RANK = 2
TINKER_LR = 5e-3
CLIP = (0.8, 1.2)  # ppo's default thresholds
ADAM = {"lr": TINKER_LR, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}  # Tinker's AdamParams defaults
TINKER_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
TINKER_JOBS = {"sft": ("cross_entropy", 31), "is": ("importance_sampling", 32), "ppo": ("ppo", 33)}
NATIVE_JOBS = {"nat1": 41, "nat2": 42}
TOL = 1e-5


@pytest.fixture(scope="module")
def server(start_server):
    yield start_server([*TINKER_JOBS, *NATIVE_JOBS], max_loras=8)
    close_clients()


def test_tinker_and_native_tenants_share_passes_and_each_trains_as_alone(server):
    reference = MultiLoraModel(device="cpu", max_loras=8)
    with ThreadPoolExecutor(len(TINKER_JOBS) + len(NATIVE_JOBS)) as pool:
        tinker_runs = {user: pool.submit(_tinker_tenant, server, user) for user in TINKER_JOBS}
        native_runs = {user: pool.submit(_native_tenant, server, user) for user in NATIVE_JOBS}
        tinker_results = {user: future.result() for user, future in tinker_runs.items()}
        native_results = {user: future.result() for user, future in native_runs.items()}

    for user, (losses, logps, adapter) in tinker_results.items():
        ref_losses, ref_logps, ref_adapter = _tinker_alone(reference, user)
        np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=TOL, err_msg=user)
        for got, want in zip(logps, ref_logps, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=user)
        _assert_same_adapter(adapter, ref_adapter, user)
    for user, (losses, adapter) in native_results.items():
        solo = SoloReference(NATIVE_JOBS[user], model=reference, name=user)
        assert losses == pytest.approx(solo.train(_native_batches(user)), abs=TOL), user
        _assert_same_adapter(adapter, solo.model.adapter_state_dict(solo.model.train_state(user)), user)

    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    shared = _counter(metrics, "twinkle_shared_pass_calls_total", 'api="tinker"')
    assert shared > 0, "no Tinker call ran in a pass with another tenant's call"
    assert _counter(metrics, "twinkle_shared_pass_calls_total", 'api="twinkle"') > 0


# ---------------------------------------------------------------------- Tinker tenants


def _tinker_data(user: str, step: int, current: list[np.ndarray] | None) -> list[types.Datum]:
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


def _probe_data(user: str, step: int) -> list[types.Datum]:
    """The RL datums' tokens, for the log-probs their sampler log-probs are made from."""
    return [sft_datum(seed) for seed in _seeds(user, step)]


def _seeds(user: str, step: int) -> list[int]:
    return [1000 * list(TINKER_JOBS).index(user) + 10 * step + i for i in range(2)]


def _tinker_tenant(server: Any, user: str) -> tuple[list[float], list[np.ndarray], dict[str, torch.Tensor]]:
    loss_fn, seed = TINKER_JOBS[user]
    client = service_client(server, user)
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=RANK, seed=seed).result()
    losses, logps = [], []
    for step in range(STEPS):
        current = None
        if user != "sft":
            current = logprobs_of(trainer.forward(_probe_data(user, step), "cross_entropy").result())
        data = _tinker_data(user, step, current)
        output = trainer.forward_backward(data, loss_fn).result()
        trainer.optim_step(types.AdamParams(learning_rate=TINKER_LR)).result()
        losses.append(output.metrics["loss:sum"])
        logps.extend(logprobs_of(output))
    path = trainer.save_state(f"{user}-final").result().path
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    folder = server.state_dir / "checkpoints" / user / parsed.training_run_id / parsed.checkpoint_id.split("/", 1)[1]
    return losses, logps, load_file(str(folder / "adapter_model.safetensors"))


def _tinker_alone(model: MultiLoraModel, user: str) -> tuple[list[float], list[np.ndarray], dict[str, torch.Tensor]]:
    """The same job in-process: Tinker's LoRA, AdamW and loss written out in torch."""
    loss_name, seed = TINKER_JOBS[user]
    config = LoraConfig(r=RANK, lora_alpha=32, target_modules=TINKER_MODULES)
    model.add_adapter_to_model(user, config, seed=seed)
    model.set_optimizer("AdamW", adapter_name=user, **ADAM)
    losses, logps = [], []
    for step in range(STEPS):
        current = None
        if user != "sft":
            sequences = _sequences(_probe_data(user, step))
            probe = model.forward_backward_targets(sequences, adapter_name=user, backward=False)
            current = [lp.double().numpy() for lp in probe.logps]
        data = _tinker_data(user, step, current)
        output = model.forward_backward_targets(_sequences(data), _reference_loss(loss_name, data), adapter_name=user)
        model.step(adapter_name=user)
        model.zero_grad(adapter_name=user)
        losses.append(output.loss)
        logps.extend(lp.double().numpy() for lp in output.logps)
    return losses, logps, model.adapter_state_dict(model.train_state(user))


def _sequences(data: list[types.Datum]) -> list[TargetSequence]:
    return [
        TargetSequence(
            torch.tensor(datum.model_input.to_ints()), torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
        )
        for datum in data
    ]


def _reference_loss(name: str, data: list[types.Datum]) -> Any:
    columns = [{key: torch.tensor(value.tolist()) for key, value in d.loss_fn_inputs.items()} for d in data]

    def loss_fn(logps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.zeros((), dtype=torch.float32)
        for lp, inputs in zip(logps, columns, strict=True):
            if name == "cross_entropy":
                total = total - (lp * inputs["weights"]).sum()
                continue
            ratio = torch.exp(lp - inputs["logprobs"])
            advantages = inputs["advantages"]
            if name == "importance_sampling":
                total = total - (ratio * advantages).sum()
            else:
                clipped = torch.clamp(ratio, *CLIP) * advantages
                total = total - torch.minimum(ratio * advantages, clipped).sum()
        return total, {}

    return loss_fn


# ---------------------------------------------------------------------- native tenants


def _native_batches(user: str) -> list[list[dict[str, Any]]]:
    return [batch(user, step, samples=2, length=6 + step) for step in range(STEPS)]


def _native_tenant(server: Any, user: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    with TwinkleClient(server.url, server.keys[user]) as client:
        run_id = new_run(client, NATIVE_JOBS[user])
        losses = []
        for inputs in _native_batches(user):
            losses.append(client.call(run_id, "forward_backward", inputs=inputs)["loss"])
            client.call(run_id, "clip_grad_and_step")
        client.call(run_id, "save", name="final", save_optimizer=False)
    folder = server.state_dir / "checkpoints" / user / run_id / "final"
    return losses, load_file(str(folder / "adapter_model.safetensors"))


# ---------------------------------------------------------------------- checks


def _assert_same_adapter(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], user: str) -> None:
    assert got.keys() == want.keys(), user
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.detach().cpu(), rtol=TOL, atol=TOL, msg=f"{user}: {name}")


def _counter(metrics: str, name: str, label: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*{label}[^}}]*\}} (\S+)$", metrics, re.M)]
    return sum(values)
