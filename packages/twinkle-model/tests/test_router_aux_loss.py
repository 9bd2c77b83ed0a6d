"""The MoE router's load-balancing loss, when the config asks for it: transformers' loss and gradients, per tenant.

With ``output_router_logits=True`` a Qwen3-MoE's own forward adds ``router_aux_loss_coef × aux`` to its
cross-entropy; ``TransformersModel.forward_backward`` must give the adapter that same gradient and report
``aux`` as ``router_aux_loss``. In a shared pass of ``MultiLoraModel`` each tenant's ``aux`` covers its
own tokens only, so each tenant's gradient equals its solo run's. Float64 throughout: top-2 routing must not
flip on a near tie between two correct implementations (see test_builtin_families.py).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from twinkle.data_format import IGNORE_INDEX
from twinkle.model import AdapterRequest, MultiLoraModel, TransformersModel

MOE = "builtin://qwen3-moe-tiny"
COEF = 0.5  # large enough that a missing or doubled router loss shows far above round-off
# float64 takes the eager expert loop: torch's grouped matmul (the default) has no float64
BASE: dict[str, Any] = {"dtype": torch.float64, "experts_implementation": "eager"}
OPTIONS: dict[str, Any] = {**BASE, "output_router_logits": True, "router_aux_loss_coef": COEF}
TOL = {"atol": 1e-10, "rtol": 1e-8}
# transformers sums the router loss's counts and probabilities in float32, even for float64 logits: its aux and
# the gradients through it are float32-exact (~1e-9 here); leaving the router loss out changes them by ~1e-4.
HF_AUX_REL = 1e-6
HF_AUX_TOL = {"atol": 1e-7, "rtol": 1e-6}


def _features(seed: int, lengths: tuple[int, ...]) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    features = []
    for length in lengths:
        ids = torch.randint(5, 2000, (length,), generator=generator).tolist()
        features.append({"input_ids": ids, "labels": [IGNORE_INDEX] * 2 + ids[2:]})
    return features


def _lora() -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=["gate.weight"])


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {
        name.replace(".default", ""): param.grad.clone()
        for name, param in model.named_parameters()
        if param.requires_grad and param.grad is not None
    }


def test_forward_backward_adds_transformers_router_loss():
    features = _features(0, (11, 7, 9))
    torch.manual_seed(3)
    model = TransformersModel(MOE, device="cpu", **OPTIONS)
    model.add_adapter_to_model("default", _lora())
    reference = copy.deepcopy(model.model)  # the same PEFT model, weights and initial adapter
    output = model.forward_backward(inputs=features)

    width = max(len(f["input_ids"]) for f in features)
    pad = [(f["input_ids"] + [0] * (width - len(f["input_ids"]))) for f in features]
    mask = [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
    labels = [f["labels"] + [IGNORE_INDEX] * (width - len(f["labels"])) for f in features]
    hf = reference(input_ids=torch.tensor(pad), attention_mask=torch.tensor(mask))
    shifted = torch.tensor(labels)[:, 1:].reshape(-1)
    cross_entropy = F.cross_entropy(hf.logits[:, :-1].reshape(shifted.numel(), -1), shifted)  # token mean, float64
    aux = load_balancing_loss_func(hf.router_logits, 8, 2, torch.tensor(mask))  # transformers' own
    (cross_entropy + COEF * aux).backward()

    assert output.metrics["router_aux_loss"] == pytest.approx(float(aux), rel=HF_AUX_REL)
    assert output.loss == pytest.approx(float(cross_entropy), rel=1e-10)  # the task loss alone
    ours, theirs = _grads(model.model), _grads(reference)
    assert sorted(ours) == sorted(theirs) and any("gate" in name for name in ours)
    for name in ours:
        assert torch.allclose(ours[name], theirs[name], **HF_AUX_TOL), name


def test_router_loss_is_off_unless_the_config_asks():
    model = TransformersModel(MOE, device="cpu", **BASE)
    model.add_adapter_to_model("default", _lora())
    assert "router_aux_loss" not in model.forward_backward(inputs=_features(0, (8,))).metrics


def test_each_tenant_balances_its_own_tokens_in_a_shared_pass():
    batches = {"a": _features(1, (12, 5)), "b": _features(2, (9, 9, 4))}

    def fresh() -> MultiLoraModel:
        model = MultiLoraModel(MOE, device="cpu", **OPTIONS)
        for index, name in enumerate(batches):
            model.add_adapter_to_model(
                name, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), seed=index
            )
        return model

    shared = fresh()
    results = shared.forward_backward_many([AdapterRequest(name, batch) for name, batch in batches.items()])
    assert all(result.error is None for result in results)
    for name, batch in batches.items():
        alone = fresh()
        output = alone.forward_backward(inputs=batch, adapter_name=name)
        together = next(result.output for result in results if result.adapter_name == name)
        assert together.metrics["router_aux_loss"] == pytest.approx(output.metrics["router_aux_loss"], rel=1e-10)
        mine, solo = shared.train_state(name).params, alone.train_state(name).params
        assert len(mine) == len(solo) > 0
        for ours, theirs in zip(mine, solo, strict=True):
            assert ours.grad is not None and torch.allclose(ours.grad, theirs.grad, **TOL)
