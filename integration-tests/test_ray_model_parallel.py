"""Model-parallel components as Ray actors: a worker per rank of the mesh, as torchrun starts a process per rank.

A call reaches every rank's actor (a batch is split by data rank only, so tensor-, pipeline-parallel and
Ulysses peers see the same samples) and the result comes from one actor per share of the batch: the losses
equal one process's. A MegatronModel (TP=2, then PP=2) syncs its weights into a sampler actor, read by both
ranks together (gathered over TP, collected over stages): the sampler gets the trainer's log-probs, LoRA
through the object store and merged by broadcast.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

ray = pytest.importorskip("ray")

import twinkle  # noqa: E402
from twinkle import DeviceGroup, DeviceMesh  # noqa: E402
from twinkle.checkpoint_engine import CheckpointEngineManager  # noqa: E402
from twinkle.data_format import SamplingParams  # noqa: E402
from twinkle.infra import get_device_placement, shutdown  # noqa: E402
from twinkle.sampler import TorchSampler  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from conversations import encoded_conversations  # noqa: E402
from logprob_gaps import max_logprob_gap  # noqa: E402

pytestmark = pytest.mark.integration
MODEL = "builtin://qwen3-tiny"
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def _losses(model, features, steps: int = 2) -> list[float]:
    model.add_adapter_to_model("default", LORA, seed=0)
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(steps):
        losses.append(model.forward_backward(inputs=features).loss)
        model.clip_grad_and_step()
    return losses


def test_ulysses_sequence_parallel_ranks_run_as_actors():
    from twinkle.model import TransformersModel

    features = encoded_conversations(MODEL)
    twinkle.initialize(mode="ray", seed=0, groups=[DeviceGroup("model", [0, 1])], lazy_collect=False, num_cpus=2)
    try:
        one_process = _losses(TransformersModel(MODEL, device="cpu"), features)
        mesh = DeviceMesh.from_sizes(fsdp_size=2, ulysses_size=2)  # one share of samples, half the tokens each
        assert _losses(TransformersModel(MODEL, remote_group="model", device_mesh=mesh), features) == pytest.approx(
            one_process, abs=1e-4
        )
    finally:
        shutdown()


def test_tensor_and_pipeline_parallel_ranks_run_as_actors_and_sync_a_sampler():
    megatron = pytest.importorskip("twinkle.model.megatron", reason="needs twinkle-model[megatron]")
    features = encoded_conversations(MODEL)
    groups = [DeviceGroup("model", [0, 1]), DeviceGroup("sampler", [2])]
    twinkle.initialize(mode="ray", seed=0, groups=groups, lazy_collect=False, num_cpus=3)
    try:
        one_process = _losses(megatron.MegatronModel(MODEL, device="cpu", dtype=torch.float64), features)
        prompts = [{"messages": [{"role": "user", "content": f"What is {n} plus 30?"}]} for n in (12, 7)]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
        for layout in ({"tp_size": 2}, {"pp_size": 2}):
            mesh = DeviceMesh.from_sizes(**layout)
            model = megatron.MegatronModel(MODEL, remote_group="model", device_mesh=mesh, dtype=torch.float64)
            assert "MegatronModel: 2 actor(s)" in get_device_placement()
            assert _losses(model, features) == pytest.approx(one_process, abs=1e-8), layout
            sampler = TorchSampler(MODEL, remote_group="sampler", dtype=torch.float64)  # its base as loaded
            sampler.set_template("Template", enable_thinking=False)
            for merge, transport in [(False, "object_store"), (True, "broadcast")]:
                CheckpointEngineManager(model, sampler, transport=transport).sync_weights(merge_and_sync=merge)
                use = {"use_base_model": True} if merge else {"adapter_name": "default"}
                sampled = sampler.sample(prompts, params, num_samples=2, **use).sequences
                inputs = [s.new_input_feature for s in sampled]
                gap = max_logprob_gap([s.logprobs for s in sampled], model.forward_only(inputs=inputs), inputs)
                assert gap < 1e-5, (layout, transport, gap)
            del model, sampler  # their actors stop: the next layout's start afresh (megatron's groups are per process)
            gc.collect()
    finally:
        shutdown()
