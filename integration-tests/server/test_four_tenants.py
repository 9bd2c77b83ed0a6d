"""The real server process serves four tenants from four client processes at once.

Each tenant's final adapter (and losses or log-probs) must equal what the same
job gives training alone in-process with the same seed: sharing the server —
and its shared passes — changes nothing for anyone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.model import MultiLoraModel
from twinkle.sampler import TorchSampler

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from tenant_jobs import JOBS, STEPS, grpo_rewards, job_features  # noqa: E402

SEED = 11
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(start_server):
    """``twinkle server`` with one user per job."""
    server = start_server(list(JOBS))
    return server.url, server.keys, server.state_dir


def test_four_tenants_at_once_get_what_they_get_alone(server):
    url, keys, state_dir = server
    workers = {
        job: subprocess.Popen(
            [sys.executable, str(HERE / "tenant_worker.py"), job, str(SEED)],
            env={**os.environ, "TWINKLE_BASE_URL": url, "TWINKLE_API_KEY": keys[job]},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job in JOBS
    }
    results = {}
    for job, worker in workers.items():
        stdout, stderr = worker.communicate(timeout=600)
        assert worker.returncode == 0, stderr[-3000:]
        results[job] = json.loads(stdout.strip().splitlines()[-1])

    for job, result in results.items():
        losses, weights = _alone_in_process(job)
        if JOBS[job]["kind"] == "forward":
            for remote, local in zip(result["losses"], losses, strict=True):
                for a, b in zip(remote, local, strict=True):
                    torch.testing.assert_close(torch.tensor(a), b, atol=1e-5, rtol=0)
        else:
            assert result["losses"] == pytest.approx(losses, abs=1e-5), job
        run_id, name = result["checkpoint"].removeprefix("twinkle://").split("/")
        saved = load_file(str(state_dir / "checkpoints" / job / run_id / name / "adapter_model.safetensors"))
        assert set(saved) == set(weights)
        # Adam moves each weight by about lr per step whatever the gradient's size, so where a gradient is near 0
        # (LoRA A while B is still ~0) the summation order of a shared pass can flip part of a step; 1% of the
        # distance Adam can travel bounds that on any CPU, while another tenant's data would move weights by ~lr.
        weight_atol = 1e-2 * JOBS[job]["lr"] * STEPS
        for key, tensor in weights.items():
            torch.testing.assert_close(saved[key], tensor.detach(), atol=weight_atol, rtol=1e-5, msg=f"{job}: {key}")


def _alone_in_process(job: str):
    """The same job, alone, in this process: the reference each tenant must match."""
    spec = JOBS[job]
    model = MultiLoraModel(device="cpu")
    model.add_adapter_to_model(job, LoraConfig(**spec["lora"]), seed=SEED)
    model.set_optimizer("AdamW", adapter_name=job, lr=spec["lr"])
    losses = []
    if spec["kind"] == "grpo":
        model.set_loss("GRPOLoss", adapter_name=job, epsilon=0.2)
        sampler = TorchSampler(device="cpu")
        for step in range(STEPS):
            CheckpointEngineManager(model, sampler, adapter_name=job).sync_weights()
            params = SamplingParams(max_tokens=4, seed=SEED + step)
            response = sampler.sample(job_features(job, step), params, adapter_name=job, num_samples=2)
            inputs = [s.new_input_feature for s in response.sequences]
            advantages = grpo_rewards([s.tokens for s in response.sequences])
            old_logps = [s.logprobs for s in response.sequences]
            losses.append(
                model.forward_backward(inputs, adapter_name=job, old_logps=old_logps, advantages=advantages).loss
            )
            model.clip_grad_and_step(adapter_name=job)
    elif spec["kind"] == "sft":
        for step in range(STEPS):
            losses.append(model.forward_backward(job_features(job, step), adapter_name=job).loss)
            model.clip_grad_and_step(adapter_name=job)
    else:
        losses = [model.forward_only(job_features(job, step), adapter_name=job).logps for step in range(STEPS)]
    return losses, model.lora_payload(job)[1]
