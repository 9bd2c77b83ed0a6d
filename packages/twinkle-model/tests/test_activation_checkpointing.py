"""Activation checkpointing recomputes decoder layers in backward and changes no gradient.

Both sides run in float64: recomputation repeats the same operations, so the gradients agree to round-off
(1e-10 here) whatever the CPU, while a layer recomputed with another adapter, dropout mask or routing would
differ by orders of magnitude more.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig

from twinkle.errors import ConfigurationError
from twinkle.model import AdapterRequest, MultiLoraModel, TransformersModel
from twinkle.model.passes.logps import inner_model

TOL = {"atol": 1e-10, "rtol": 1e-10}


def _count_layer_forwards(model: Any) -> list[int]:
    """Forwards per decoder layer, counted from now on (by its MLP: hooks of the layer itself run once)."""
    counts = []
    for layer in inner_model(model.model).get_decoder().layers:
        counts.append(0)
        index = len(counts) - 1
        layer.mlp.register_forward_pre_hook(lambda *_, index=index: counts.__setitem__(index, counts[index] + 1))
    return counts


def _grads(model: Any, adapters: list[str]) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{index}": param.grad.clone()
        for name in adapters
        for index, param in enumerate(model.train_state(name).params)
    }


def _lora_model(policy: Any) -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(dtype=torch.float64, device="cpu", gradient_checkpointing=policy)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1)  # masks are replayed
    model.add_adapter_to_model("a", config, seed=0)
    return model


def test_checkpointed_lora_steps_have_the_plain_gradients_and_recompute_each_layer(sft_features) -> None:
    batch = sft_features[:4]
    plain = _lora_model(False)
    torch.manual_seed(1)
    plain_loss = plain.forward_backward(batch).loss
    for policy, recomputed in ((True, [2, 2, 2, 2]), (2, [2, 1, 2, 1])):
        model = _lora_model(policy)
        counts = _count_layer_forwards(model)
        torch.manual_seed(1)
        loss = model.forward_backward(batch).loss
        assert counts == recomputed, counts  # every (or every 2nd) layer ran again in backward
        assert loss == pytest.approx(plain_loss, rel=1e-12)
        for name, grad in _grads(plain, ["a"]).items():
            assert torch.allclose(_grads(model, ["a"])[name], grad, **TOL), name


def _multi_lora(policy: Any) -> MultiLoraModel:
    model = MultiLoraModel(dtype=torch.float64, device="cpu", gradient_checkpointing=policy)
    model.add_adapter_to_model("a", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]), seed=1)
    model.add_adapter_to_model("b", LoraConfig(r=8, lora_alpha=8, target_modules=["v_proj", "lm_head"]), seed=2)
    for name in ("a", "b"):
        for param in model.train_state(name).params:  # B = 0 would hide a layer recomputed without its adapter
            torch.nn.init.normal_(param, std=0.05)
    return model


def test_shared_passes_and_stepwise_calls_recompute_with_each_rows_adapter(sft_features) -> None:
    def train(policy: Any) -> dict[str, torch.Tensor]:
        torch.manual_seed(3)
        model = _multi_lora(policy)
        counts = _count_layer_forwards(model)
        results = model.forward_backward_many(
            [AdapterRequest("a", sft_features[:3]), AdapterRequest("b", sft_features[3:5])]
        )
        assert all(result.error is None for result in results), [result.error for result in results]
        model.forward(sft_features[5:7], adapter_name="b")  # forward → calculate_loss → backward, routed again
        model.calculate_loss(adapter_name="b")
        model.backward(adapter_name="b")
        assert counts == [4 if policy else 2] * len(counts), counts
        return _grads(model, ["a", "b"])

    plain, checkpointed = train(False), train(True)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        assert torch.allclose(checkpointed[name], grad, **TOL), name


@pytest.mark.parametrize("policy", [0, -1, "yes", 1.5])
def test_a_bad_policy_is_refused_by_name(policy: Any) -> None:
    with pytest.raises(ConfigurationError, match="gradient_checkpointing must be True, False or a layer interval"):
        TransformersModel(device="cpu", gradient_checkpointing=policy)
