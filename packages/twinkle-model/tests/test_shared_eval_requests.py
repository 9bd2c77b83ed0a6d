"""Evaluation requests in shared passes: ``AdapterRequest(..., backward=False)`` is an adapter's ``forward_only``.

Tenants reading log-probs (an RL recipe's reference or old log-probs) share a pass, beside other tenants'
training: each reads what plain PEFT computes for its adapter, its gradients stay untouched, and a training
request in the same call trains exactly as it does alone. Float64 as in ``test_multi_lora_equivalence`` (in
float32 padded and unpadded rows sum in different orders), so the 1e-10 tolerance holds on any CPU.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.hub import resolve_model
from twinkle.model import AdapterRequest, MultiLoraModel

DTYPE = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-10}
CONFIGS = {
    "a": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0),
    "b": LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
}


def _feature(generator: torch.Generator, length: int) -> dict[str, Any]:
    ids = torch.randint(0, 5000, (length,), generator=generator).tolist()
    return make_input_feature(ids, [IGNORE_INDEX] * (length // 3) + ids[length // 3 :])


def _reference_logps(model: torch.nn.Module, feature: dict[str, Any]) -> torch.Tensor:
    """log p(labels[t] | tokens < t) on trained positions, 0 elsewhere (position 0 predicts nothing)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([feature["input_ids"]])).logits[0]
    labels = torch.tensor(feature["labels"])
    picked = torch.log_softmax(logits[:-1], -1).gather(-1, labels[1:].clamp(min=0)[:, None]).squeeze(-1)
    return torch.cat([picked.new_zeros(1), torch.where(labels[1:] != IGNORE_INDEX, picked, torch.zeros_like(picked))])


@pytest.fixture(scope="module")
def setup():
    """The model with adapters a and b (B perturbed, so each differs from the base), their PEFT twins, batches."""
    model = MultiLoraModel(device="cpu", max_loras=2, max_rank=8, dtype=DTYPE)
    references = {}
    for index, (name, config) in enumerate(CONFIGS.items()):
        model.add_adapter_to_model(name, config)
        _, payload = model.lora_payload(name)
        generator = torch.Generator().manual_seed(10 + index)
        with torch.no_grad():
            for key, tensor in payload.items():
                if ".lora_B." in key:
                    tensor.normal_(0, 0.05, generator=generator)
        base = AutoModelForCausalLM.from_pretrained(resolve_model("builtin://qwen3-tiny"), dtype=DTYPE)
        reference = get_peft_model(base, copy.deepcopy(config))
        set_peft_model_state_dict(reference, {key: tensor.detach().clone() for key, tensor in payload.items()})
        references[name] = reference.eval()
        model.set_optimizer("SGD", adapter_name=name, lr=0.1)
    generator = torch.Generator().manual_seed(7)
    batches = {name: [_feature(generator, length) for length in (9, 14, 6)] for name in CONFIGS}
    return model, references, batches


def _untouched(model: MultiLoraModel, name: str) -> bool:
    state = model.train_state(name)
    return state.accumulated == 0 and all(param.grad is None for param in state.params)


def test_evaluation_requests_share_a_pass_and_read_what_plain_peft_computes(setup):
    model, references, batches = setup
    results = model.forward_backward_many([AdapterRequest(name, batches[name], backward=False) for name in CONFIGS])
    for name, result in zip(CONFIGS, results, strict=True):
        output = result.unwrap()
        alone = model.forward_only(batches[name], adapter_name=name)
        for feature, logps, logps_alone in zip(batches[name], output.logps, alone.logps, strict=True):
            expected = _reference_logps(references[name], feature)
            torch.testing.assert_close(torch.as_tensor(logps, dtype=DTYPE), expected, **TOL)
            torch.testing.assert_close(torch.as_tensor(logps_alone, dtype=DTYPE), expected, **TOL)
        assert output.loss == pytest.approx(alone.loss, rel=1e-10)
        assert _untouched(model, name)


def test_a_training_request_beside_an_evaluation_one_trains_as_it_does_alone(setup):
    model, _, batches = setup
    reading, training = model.forward_backward_many(
        [AdapterRequest("a", batches["a"], backward=False), AdapterRequest("b", batches["b"])]
    )
    assert _untouched(model, "a") and reading.ok
    params = model.train_state("b").params
    shared_grads = [param.grad.clone() for param in params]
    model.zero_grad("b")
    alone = model.forward_backward(batches["b"], adapter_name="b")
    for shared, param in zip(shared_grads, params, strict=True):
        torch.testing.assert_close(shared, param.grad, **TOL)
    assert training.unwrap().loss == pytest.approx(alone.loss, rel=1e-10)
    model.zero_grad("b")
