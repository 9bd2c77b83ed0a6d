"""Weight sync by bucketed broadcast between Ray actors: the model's actor to two sampler actors, over gloo.

The path GPUs take over NCCL (``transport="auto"`` picks it where both sides are on CUDA), forced here on
CPUs with ``transport="broadcast"`` and buckets far smaller than the model, so that weights span buckets and
large tensors travel alone. After a LoRA sync and after a merged one, every sampler actor's log-probs of its
completions equal the trainer's; the rendezvous and the group listen on 127.0.0.1 only. A model sharded
over two actors (FSDP2) is read whole by both of them together, by either transport.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")


import twinkle  # noqa: E402
from twinkle import DeviceGroup, DeviceMesh  # noqa: E402
from twinkle.infra import device_group_of, shutdown  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from logprob_gaps import max_logprob_gap  # noqa: E402  # beside this file

pytestmark = pytest.mark.integration


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.parametrize(
    ("device_type", "transport", "samplers"),
    [
        ("cpu", "broadcast", 2),
        pytest.param(
            "cuda",
            "auto",  # NCCL: both sides on CUDA
            1,
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(_cuda_devices() < 2, reason="NCCL between two processes needs two GPUs"),
            ],
        ),
    ],
    ids=["gloo", "nccl"],
)
def test_lora_and_merged_syncs_broadcast_from_the_model_actor_to_every_sampler_actor(device_type, transport, samplers):
    from peft import LoraConfig

    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.data_format import SamplingParams
    from twinkle.errors import ConfigurationError
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    sampler_ranks = list(range(1, 1 + samplers))
    groups = [DeviceGroup("model", [0], device_type), DeviceGroup("sampler", sampler_ranks, device_type)]
    twinkle.initialize(mode="ray", seed=0, groups=groups, lazy_collect=False, num_cpus=3)
    try:
        model = TransformersModel(remote_group="model")
        model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"), seed=0)
        model.set_optimizer("AdamW", lr=1e-2)
        model.set_loss("GRPOLoss", epsilon=0.2)
        sampler = TorchSampler(remote_group="sampler", device_mesh=DeviceMesh.from_sizes(dp_size=samplers))
        sampler.set_template("Template", enable_thinking=False)
        assert device_group_of(model).ranks == [0] and device_group_of(sampler).ranks == sampler_ranks  # apart
        manager = CheckpointEngineManager(model, sampler, transport=transport, bucket_mb=0.25)
        prompts = [{"messages": [{"role": "user", "content": f"What is {n} plus 30?"}]} for n in (12, 7)]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)

        manager.sync_weights()
        first = sampler.sample(prompts, params, adapter_name="default", num_samples=2).sequences
        inputs = [s.new_input_feature for s in first]
        model.forward_backward(inputs=inputs, old_logps=[s.logprobs for s in first], advantages=[1.0, 0.5, -1.0, 0.25])
        model.clip_grad_and_step()
        moved = max_logprob_gap([s.logprobs for s in first], model.forward_only(inputs=inputs), inputs)
        assert moved > 1e-3  # the step changed the adapter

        started = time.perf_counter()
        manager.sync_weights()  # the group made by the first sync carries the second
        lora_seconds = time.perf_counter() - started
        second = sampler.sample(prompts, params, adapter_name="default", num_samples=2).sequences
        trained = [s.new_input_feature for s in second]
        assert max_logprob_gap([s.logprobs for s in second], model.forward_only(inputs=trained), trained) < 1e-4

        started = time.perf_counter()
        manager.sync_weights(merge_and_sync=True)  # every base weight, the adapter merged in, bucket by bucket
        merged_seconds = time.perf_counter() - started
        print(f"{transport} on {device_type}: LoRA sync {lora_seconds:.3f} s, merged sync {merged_seconds:.3f} s")
        merged = sampler.sample(prompts, params, use_base_model=True, num_samples=2).sequences
        served = [s.new_input_feature for s in merged]
        assert max_logprob_gap([s.logprobs for s in merged], model.forward_only(inputs=served), served) < 1e-4
        assert _listeners_of_this_test_are_loopback()

        # A payload the model's side cannot read fails there, and its receivers stop with its message.
        model.add_adapter_to_model("dora", LoraConfig(r=4, target_modules=["q_proj"], use_dora=True), seed=0)
        refused = CheckpointEngineManager(model, sampler, adapter_name="dora", transport=transport)
        with pytest.raises(ConfigurationError, match="adapter 'dora' uses DoRA"):
            refused.sync_weights()
        advantages = [1.0, 0.5, -1.0, 0.25]
        model.forward_backward(
            inputs=inputs, adapter_name="default", old_logps=[s.logprobs for s in first], advantages=advantages
        )
        model.clip_grad_and_step(adapter_name="default")
        manager.sync_weights(merge_and_sync=True)  # the first manager's group is unharmed
        again = sampler.sample(prompts, params, use_base_model=True, num_samples=2).sequences
        features = [s.new_input_feature for s in again]
        trainer = model.forward_only(inputs=features, adapter_name="default")
        assert max_logprob_gap([s.logprobs for s in again], trainer, features) < 1e-4

        with pytest.raises(ConfigurationError, match="transport must be one of"):
            CheckpointEngineManager(model, sampler, transport="nccl")
        with pytest.raises(ConfigurationError, match="bucket_mb must be positive, got 0"):
            CheckpointEngineManager(model, sampler, bucket_mb=0)
    finally:
        shutdown()


def test_a_model_sharded_over_two_actors_syncs_whole_weights_by_either_transport():
    """FSDP2 over the model's two workers: each holds half of every weight, and reading them is a collective."""
    from peft import LoraConfig

    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.data_format import SamplingParams
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    groups = [DeviceGroup("model", [0, 1]), DeviceGroup("sampler", [2])]
    twinkle.initialize(mode="ray", seed=0, groups=groups, lazy_collect=False, num_cpus=3)
    try:
        model = TransformersModel(remote_group="model", device_mesh=DeviceMesh.from_sizes(fsdp_size=2))
        model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"), seed=0)
        model.set_optimizer("AdamW", lr=1e-2)
        model.set_loss("GRPOLoss", epsilon=0.2)
        sampler = TorchSampler(remote_group="sampler")
        sampler.set_template("Template", enable_thinking=False)
        prompts = [{"messages": [{"role": "user", "content": f"What is {n} plus 30?"}]} for n in (12, 7)]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
        # The LoRA sync first: after a merged one the sampler's base holds the adapter already
        for merge, transport in [(False, "object_store"), (True, "broadcast")]:
            manager = CheckpointEngineManager(model, sampler, transport=transport, bucket_mb=0.25)
            manager.sync_weights(merge_and_sync=merge)
            use = {"use_base_model": True} if merge else {"adapter_name": "default"}
            before = sampler.sample(prompts, params, num_samples=2, **use).sequences
            inputs = [s.new_input_feature for s in before]
            advantages = [1.0, 0.5, -1.0, 0.25]
            model.forward_backward(inputs=inputs, old_logps=[s.logprobs for s in before], advantages=advantages)
            model.clip_grad_and_step()
            assert max_logprob_gap([s.logprobs for s in before], model.forward_only(inputs=inputs), inputs) > 1e-3

            manager.sync_weights(merge_and_sync=merge)
            after = sampler.sample(prompts, params, num_samples=2, **use).sequences
            served = [s.new_input_feature for s in after]
            gap = max_logprob_gap([s.logprobs for s in after], model.forward_only(inputs=served), served)
            assert gap < 1e-4, (merge, transport, gap)
    finally:
        shutdown()


def test_broadcast_needs_actors_on_both_sides():
    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.errors import ConfigurationError
    from twinkle.model import TransformersModel
    from twinkle.sampler import TorchSampler

    model, sampler = TransformersModel(device="cpu"), TorchSampler(device="cpu")  # in this process
    manager = CheckpointEngineManager(model, sampler, transport="broadcast")
    with pytest.raises(ConfigurationError, match="transport='broadcast' moves weights between actors"):
        manager.sync_weights(merge_and_sync=True)


def _listeners_of_this_test_are_loopback() -> bool:
    """Every listening TCP socket of this process's descendants (Ray, its actors, their stores) is on 127.0.0.1."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    rows = [tuple(map(int, line.split())) for line in table if line.strip()]
    tree = {os.getpid()}
    while grown := {pid for pid, ppid in rows if ppid in tree} - tree:
        tree |= grown
    addresses = []
    for line in subprocess.run(["ss", "-tnlpH"], capture_output=True, text=True).stdout.splitlines():
        if {int(pid) for pid in re.findall(r"pid=(\d+)", line)} & tree:
            addresses.append(line.split()[3])
    assert addresses, "no listening socket found: ss cannot see this test's processes"
    return all(re.match(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$", a) for a in addresses), addresses
