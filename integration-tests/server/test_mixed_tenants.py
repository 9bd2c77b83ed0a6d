"""Tinker and native tenants train at once on one server, in the same shared passes, each as if alone.

Three tinker SDK clients (cross-entropy SFT, ``importance_sampling`` RL and
``ppo`` with clipping in play) and two native ``twinkle_client`` clients train
together, each in its own process (``mixed_tenant_worker.py``). Every
tenant's losses, log-probs and saved adapter must equal its solo in-process
run (float32, 1e-5): the reference is a plain ``MultiLoraModel`` with the loss
written out here in torch. ``/metrics`` must show Tinker calls trained in
passes together with other tenants' calls.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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

sys.path.insert(0, str(Path(__file__).parent))
from harness import SoloReference
from mixed_tenant_worker import (
    NATIVE_JOBS,
    RANK,
    RESULT,
    STEPS,
    TINKER_JOBS,
    TINKER_LR,
    native_batches,
    probe_data,
    tinker_data,
)
from sdk_process import script_command

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
CLIP = (0.8, 1.2)  # ppo's default thresholds
ADAM = {"lr": TINKER_LR, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}  # Tinker's AdamParams defaults
TINKER_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
TOL = 1e-5


@pytest.fixture(scope="module")
def server(start_server):
    return start_server([*TINKER_JOBS, *NATIVE_JOBS], max_loras=8)


def test_tinker_and_native_tenants_share_passes_and_each_trains_as_alone(server, tmp_path):
    results = _run_tenants(server, tmp_path)
    reference = MultiLoraModel(device="cpu", max_loras=8)
    for user in TINKER_JOBS:
        ref_losses, ref_logps, ref_adapter = _tinker_alone(reference, user)
        np.testing.assert_allclose(results[user]["losses"], ref_losses, rtol=TOL, atol=TOL, err_msg=user)
        for got, want in zip(results[user]["logps"], ref_logps, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=TOL, err_msg=user)
        _assert_same_adapter(_saved_adapter(server, user, results[user]), ref_adapter, user)
    for user in NATIVE_JOBS:
        solo = SoloReference(NATIVE_JOBS[user], model=reference, name=user)
        assert results[user]["losses"] == pytest.approx(solo.train(native_batches(user)), abs=TOL), user
        want = solo.model.adapter_state_dict(solo.model.train_state(user))
        _assert_same_adapter(_saved_adapter(server, user, results[user]), want, user)

    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    shared = _counter(metrics, "twinkle_shared_pass_calls_total", 'api="tinker"')
    assert shared > 0, "no Tinker call ran in a pass with another tenant's call"
    assert _counter(metrics, "twinkle_shared_pass_calls_total", 'api="twinkle"') > 0


# ---------------------------------------------------------------------- the tenants' processes


def _run_tenants(server: Any, logs: Path) -> dict[str, dict[str, Any]]:
    """Every tenant's worker process, all started at once; their results by user (their stderr in ``logs``)."""
    workers = {}
    for user in [*TINKER_JOBS, *NATIVE_JOBS]:
        with open(logs / f"{user}.stderr", "w") as stderr:  # a file: a full pipe would stall a worker
            workers[user] = subprocess.Popen(
                script_command(str(HERE / "mixed_tenant_worker.py"), user, server.url, server.keys[user]),
                env={**os.environ, "TINKER_TELEMETRY": "0"},
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
    results = {}
    for user, worker in workers.items():
        stdout, _ = worker.communicate(timeout=600)
        errors = (logs / f"{user}.stderr").read_text()[-3000:]
        assert worker.returncode == 0, f"{user}'s process exited {worker.returncode}:\n{errors}"
        line = [line for line in stdout.splitlines() if line.startswith(RESULT)][-1]
        results[user] = json.loads(line[len(RESULT) :])
    return results


def _saved_adapter(server: Any, user: str, result: dict[str, Any]) -> dict[str, torch.Tensor]:
    folder = server.state_dir / "checkpoints" / user / Path(*result["checkpoint"])
    return load_file(str(folder / "adapter_model.safetensors"))


# ---------------------------------------------------------------------- in-process references


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
            sequences = _sequences(probe_data(user, step))
            probe = model.forward_backward_targets(sequences, adapter_name=user, backward=False)
            current = [lp.double().numpy() for lp in probe.logps]
        data = tinker_data(user, step, current)
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


# ---------------------------------------------------------------------- checks


def _assert_same_adapter(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], user: str) -> None:
    assert got.keys() == want.keys(), user
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.detach().cpu(), rtol=TOL, atol=TOL, msg=f"{user}: {name}")


def _counter(metrics: str, name: str, label: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*{label}[^}}]*\}} (\S+)$", metrics, re.M)]
    return sum(values)
