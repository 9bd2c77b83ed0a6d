"""``MultiLoraMegatronModel``: tenants trained together on one megatron-core base equal each trained alone.

Three tenants — their own ranks, alphas, targets, optimizers, clipping and batch sizes — train for 3 steps in
shared ``forward_backward_many`` passes over the dense and the MoE builtin (where PEFT's "all-linear" adapts the
attention, the fused experts and the router, so a MoE layer's tokens go to each row's adapter too). A
``MegatronModel`` training each tenant alone, from the same initial weights, gets the same losses, gradient
norms and adapter tensors (float64, 1e-8, MoE 1e-6: only summation order differs; see test_megatron.py, which checks
``MegatronModel``'s adapters against PEFT). A bad request fails alone; slots and ranks are bounded; a removed
adapter frees its slot. The tensor-parallel run is in integration-tests/test_megatron_parallel.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model import AdapterRequest

megatron = pytest.importorskip("twinkle.model.megatron", reason="needs twinkle-model[megatron]")

MODEL = "builtin://qwen3-tiny"
MOE_MODEL = "builtin://qwen3-moe-tiny"
DTYPE = torch.float64
STEPS = 3
TOL = {"abs": 1e-8}
# MoE: the router's softmax runs in float32 (as transformers'), where another batch's float64 round-off can flip
# an ulp (see test_megatron_parallel.py's MOE_TOL); a routing mistake is orders of magnitude larger.
MOE_TOL = {"abs": 1e-6}
# name -> (LoraConfig arguments, optimizer arguments, max_grad_norm, batch size)
TENANTS: dict[str, tuple[dict[str, Any], dict[str, Any], float, int]] = {
    "all": ({"r": 2, "lora_alpha": 4, "target_modules": "all-linear"}, {"lr": 1e-2}, 1.0, 3),
    "qv": ({"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}, {"lr": 3e-2}, 0.05, 2),
    "out": ({"r": 4, "lora_alpha": 16, "target_modules": ["o_proj", "k_proj", "lm_head"]}, {"lr": 5e-3}, 10.0, 1),
}


def _add_tenants(model: Any) -> None:
    for seed, (name, (config, optimizer, _, _)) in enumerate(TENANTS.items()):
        model.add_adapter_to_model(name, LoraConfig(**config), seed=seed)
        model.set_optimizer("AdamW", adapter_name=name, **optimizer)


def _batches(features: list[dict[str, Any]]) -> dict[str, list[list[dict[str, Any]]]]:
    """Each tenant's batch of each step: its own features, none shared with another tenant."""
    batches: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in TENANTS}
    cursor = 0
    for _step in range(STEPS):
        for name, (_, _, _, size) in TENANTS.items():
            batches[name].append([features[(cursor + i) % len(features)] for i in range(size)])
            cursor += size
    return batches


def _trained_together(model_id: str, batches: dict[str, Any]) -> tuple[Any, dict[str, list[float]]]:
    model = megatron.MultiLoraMegatronModel(model_id, device="cpu", dtype=DTYPE, max_loras=3, max_rank=8)
    _add_tenants(model)
    record: dict[str, list[float]] = {f"{name}-{what}": [] for name in TENANTS for what in ("loss", "norm")}
    for step in range(STEPS):
        requests = [AdapterRequest(name, batches[name][step]) for name in TENANTS]
        for name, result in zip(TENANTS, model.forward_backward_many(requests), strict=True):
            record[f"{name}-loss"].append(result.unwrap().loss)
            norm = model.clip_grad_and_step(max_grad_norm=TENANTS[name][2], adapter_name=name)
            record[f"{name}-norm"].append(norm["grad_norm"])
    return model, record


def _trained_alone(model_id: str, batches: dict[str, Any]) -> tuple[Any, dict[str, list[float]]]:
    model = megatron.MegatronModel(model_id, device="cpu", dtype=DTYPE)
    _add_tenants(model)  # each forward below runs one of them; the others sit idle
    record: dict[str, list[float]] = {f"{name}-{what}": [] for name in TENANTS for what in ("loss", "norm")}
    for name in TENANTS:
        for step in range(STEPS):
            record[f"{name}-loss"].append(model.forward_backward(batches[name][step], adapter_name=name).loss)
            norm = model.clip_grad_and_step(max_grad_norm=TENANTS[name][2], adapter_name=name)
            record[f"{name}-norm"].append(norm["grad_norm"])
    return model, record


@pytest.mark.parametrize("model_id", [MODEL, MOE_MODEL], ids=["dense", "moe"])
def test_tenants_trained_together_equal_each_trained_alone(model_id, sft_features):
    batches = _batches(sft_features)
    together, shared = _trained_together(model_id, batches)
    alone, solo = _trained_alone(model_id, batches)
    tol = MOE_TOL if model_id == MOE_MODEL else TOL
    for key, values in solo.items():
        assert shared[key] == pytest.approx(values, **tol), key
    assert sum(norm > 0.05 for norm in shared["qv-norm"][1:]) >= 1  # the tight clip binds after B moves
    for name in TENANTS:
        ours = together.adapter_state_dict(together.train_state(name))
        theirs = alone.adapter_state_dict(alone.train_state(name))
        assert set(ours) == set(theirs)
        for key, tensor in ours.items():
            assert torch.allclose(tensor, theirs[key], atol=tol["abs"], rtol=0), key
    if model_id == MOE_MODEL:  # the experts and the router were adapted, and trained
        expert_keys = [key for key in together.adapter_state_dict(together.train_state("all")) if ".mlp." in key]
        assert any("experts" in key for key in expert_keys) and any("mlp.gate" in key for key in expert_keys)


def test_a_bad_request_fails_alone_and_slots_and_ranks_are_bounded(sft_features):
    model = megatron.MultiLoraMegatronModel(MODEL, device="cpu", dtype=DTYPE, max_loras=2, max_rank=4)
    model.add_adapter_to_model("a", LoraConfig(r=4, target_modules=["q_proj"]), seed=0)
    model.set_optimizer("AdamW", adapter_name="a")
    with pytest.raises(ConfigurationError, match=r"ranks \{'r': 8\} are outside 1..4"):
        model.add_adapter_to_model("big", LoraConfig(r=8, target_modules=["q_proj"]))
    model.add_adapter_to_model("b", LoraConfig(r=2, target_modules=["v_proj"]), seed=1)
    with pytest.raises(ConfigurationError, match="all 2 adapter slots are in use"):
        model.add_adapter_to_model("c", LoraConfig(r=2, target_modules=["v_proj"]))
    alone = model.forward_only(sft_features[:2], adapter_name="a").loss
    results = model.forward_backward_many(
        [AdapterRequest("a", sft_features[:2]), AdapterRequest("b", [{"input_ids": []}]), {"adapter_name": "nope"}]
    )
    assert results[0].unwrap().loss == pytest.approx(alone, abs=1e-12)
    assert isinstance(results[1].error, InvalidInputError) and results[2].error is not None
    model.remove_adapter("b")
    assert model.adapter_names == ["a"]
    model.add_adapter_to_model("c", LoraConfig(r=2, target_modules=["v_proj"]))
    assert model.adapter_config("c").r == 2
