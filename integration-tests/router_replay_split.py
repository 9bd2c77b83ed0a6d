"""Under ``torchrun --nproc_per_node 2``: router replay with Ulysses sequence parallelism over FSDP2 equals it alone.

Each rank samples the same completions (recording routing), then trains a drifted-router copy of the MoE
builtin two ways: split (``fsdp_size = ulysses_size = 2``) and in this process alone. Rank 0 prints the
two runs' losses and replayed log-probs as JSON. test_router_replay.py runs and reads it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.data_format import SamplingParams
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler

MOE = "builtin://qwen3-moe-tiny"
OPTIONS: dict[str, Any] = {"dtype": torch.float64, "experts_implementation": "eager"}  # grouped matmul: no fp64
PROMPTS = [{"input_ids": [151644, 872, 198, 9707, 11, 1246]}, {"input_ids": [151644, 872, 198, 3838]}]


def sampled_features() -> tuple[list[dict[str, Any]], list[list[float]]]:
    """The sampler's completions (features with ``routed_experts``) and their log-probs."""
    sampler = TorchSampler(MOE, device="cpu", record_routing=True, **OPTIONS)
    response = sampler.sample(PROMPTS, SamplingParams(max_tokens=12, num_samples=2, logprobs=0, seed=7))
    return [dict(s.new_input_feature) for s in response.sequences], [list(s.logprobs) for s in response.sequences]


def drifted(model: TransformersModel) -> TransformersModel:
    """``model`` with its routers' weights perturbed, so that its own routing differs from the recorded one."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.5)
    return model


def _run(mesh: DeviceMesh, features: list[dict[str, Any]]) -> dict[str, Any]:
    model = drifted(TransformersModel(MOE, device="cpu", device_mesh=mesh, **OPTIONS))
    model.add_adapter_to_model("default", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), seed=0)
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(inputs=features).loss)
        model.clip_grad_and_step()
    logps = [t.tolist() for t in model.forward_only(inputs=features).logps]
    return {"losses": losses, "logps": logps}


def main() -> None:
    twinkle.initialize(seed=0)
    features, _ = sampled_features()
    world = int(os.environ["WORLD_SIZE"])
    split = _run(DeviceMesh.from_sizes(world_size=world, fsdp_size=world, ulysses_size=world), features)
    alone = _run(DeviceMesh.from_sizes(), features)
    if twinkle.is_master():
        print("RESULT " + json.dumps({"split": split, "alone": alone}), flush=True)


if __name__ == "__main__":
    main()
