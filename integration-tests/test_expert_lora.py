"""LoRA on a MoE model's experts and router, served per batch row, against plain PEFT.

On transformers' MoE families PEFT's ``"all-linear"`` also adapts each layer's fused experts
(``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, one rank-r pair per expert) and its router
weight. ``MultiLoraModel`` trains such an adapter in a pass shared with other adapters, and
``TorchSampler`` serves it beside other adapters and the base model, each row with its own weights.
Checked on the MoE builtin in float64 (the eager expert loop: torch's grouped matmul has no float64):
the shared pass's loss and gradients equal PEFT's for the adapter alone; the adapter trained here loads in
plain PEFT with the trainer's logits; the sampler's log-probs equal the trainer's in a batch that mixes
the adapter with the base model, with router replay too; and what the layers cannot compute is refused.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.model import AdapterRequest, MultiLoraModel, TransformersModel
from twinkle.module import MultiLoraExperts, MultiLoraRouter, adapter_names
from twinkle.sampler import TorchSampler

sys.path.insert(0, str(Path(__file__).parent))
from conversations import encoded_conversations

MOE = "builtin://qwen3-moe-tiny"
OPTIONS: dict[str, Any] = {"dtype": torch.float64, "experts_implementation": "eager"}
ALL_LINEAR = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")

pytestmark = [pytest.mark.integration]


def _plain() -> Any:
    return AutoModelForCausalLM.from_pretrained(resolve_model(MOE), **OPTIONS)


@pytest.fixture(scope="module")
def features() -> list[dict[str, Any]]:
    return encoded_conversations(MOE)


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An all-linear PEFT adapter on the MoE builtin with every LoRA weight random (B too), saved."""
    model = get_peft_model(_plain(), copy.deepcopy(ALL_LINEAR))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.2)
    directory = tmp_path_factory.mktemp("peft") / "moe"
    model.save_pretrained(directory)
    return directory


def _peft_grads(directory: Path, features: list[dict[str, Any]]) -> tuple[float, dict[str, torch.Tensor]]:
    """PEFT alone: token-mean cross-entropy of ``features`` and its gradients, by saved key."""
    model = PeftModel.from_pretrained(_plain(), directory, is_trainable=True)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for feature in features:
        labels = torch.tensor(feature["labels"])
        logits = model(torch.tensor([feature["input_ids"]])).logits[0]
        total = total + F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels[1:] != IGNORE_INDEX).sum())
    loss = total / count
    loss.backward()
    grads = {
        name.replace(".default.", "."): param.grad
        for name, param in model.named_parameters()
        if param.requires_grad and param.grad is not None
    }
    return float(loss), grads


def test_the_adapter_adapts_experts_and_router(peft_adapter):
    model = MultiLoraModel(MOE, device="cpu", **OPTIONS)
    model.add_adapter_to_model("moe", str(peft_adapter))
    block = model.model.model.layers[0].mlp
    assert isinstance(block.experts, MultiLoraExperts) and isinstance(block.gate, MultiLoraRouter)
    _, tensors = model.lora_payload("moe")
    experts = 8
    # PEFT's layout: gate_up_proj (rank 2r: gate and up) nested inside down_proj, both r per expert.
    assert tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape == (8 * experts, 64)
    assert tensors["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].shape == (64, 4 * experts)
    assert tensors["base_model.model.model.layers.0.mlp.gate.lora_B.weight"].shape == (experts, 4)


def test_mlp_targets_adapt_the_experts_as_peft_maps_them():
    """Tinker's train_mlp (gate/up/down_proj) on a MoE model: the fused experts, gate_up_proj at twice the rank."""
    model = MultiLoraModel(MOE, device="cpu", **OPTIONS)
    mlp = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model.add_adapter_to_model("mlp", LoraConfig(r=4, lora_alpha=32, target_modules=mlp), seed=0)
    config = model.adapter_config("mlp")
    assert sorted(config.target_parameters) == ["down_proj", "gate_up_proj"]
    assert config.rank_pattern == {r".*\.gate_up_proj": 8} and config.alpha_pattern == {r".*\.gate_up_proj": 64}
    _, tensors = model.lora_payload("mlp")
    assert tensors["base_model.model.model.layers.3.mlp.experts.base_layer.lora_A.weight"].shape == (8 * 8, 64)


def test_a_shared_pass_gives_the_expert_adapter_pefts_loss_and_gradients(peft_adapter, features):
    model = MultiLoraModel(MOE, device="cpu", **OPTIONS)
    model.add_adapter_to_model("moe", str(peft_adapter))
    model.add_adapter_to_model("attn", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]), seed=1)
    results = model.forward_backward_many([AdapterRequest("moe", features[:2]), AdapterRequest("attn", features[2:])])
    assert all(result.error is None for result in results), [result.error for result in results]
    loss, expected = _peft_grads(peft_adapter, features[:2])
    assert results[0].output.loss == pytest.approx(loss, rel=1e-10)
    _, tensors = model.lora_payload("moe")
    assert set(tensors) == set(expected)
    for key, param in tensors.items():
        assert torch.allclose(param.grad, expected[key], atol=1e-10, rtol=1e-8), key
    assert any(float(grad.abs().max()) > 1e-4 for key, grad in expected.items() if ".experts." in key)


def test_trained_expert_adapter_loads_in_peft_and_samples_the_trainers_logprobs(features, tmp_path: Path):
    model = MultiLoraModel(MOE, device="cpu", **OPTIONS)
    model.add_adapter_to_model("moe", copy.deepcopy(ALL_LINEAR), seed=0)
    model.set_optimizer("AdamW", lr=2e-2, adapter_name="moe")
    losses = []
    for _ in range(4):
        losses.append(model.forward_backward(features, adapter_name="moe").loss)
        model.clip_grad_and_step(adapter_name="moe")
    assert losses[-1] < losses[0] - 0.5, losses
    path = model.save("moe", output_dir=tmp_path, adapter_name="moe")
    peft = PeftModel.from_pretrained(_plain(), path).eval()
    ours = model.forward_only(features, return_logits=True, adapter_name="moe").logits
    with torch.no_grad():
        theirs = [peft(torch.tensor([f["input_ids"]])).logits[0] for f in features]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()

    # One batch mixing the adapter's rows with the base model's; each row's log-probs are its trainer's,
    # with the sampler's routing replayed and without.
    sampler = TorchSampler(MOE, device="cpu", record_routing=True, **OPTIONS)
    sampler.load_adapter("moe", path)
    prompts = [{"input_ids": [151644, 872, 198, 9707, 11]}, {"input_ids": [151644, 872, 198, 3838]}]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    sequences = sampler.sample(prompts * 2, params, adapter_name=["moe", "moe", None, None]).sequences
    sampled = [dict(sequence.new_input_feature) for sequence in sequences]
    free = [{k: v for k, v in feature.items() if k != "routed_experts"} for feature in sampled]
    base = TransformersModel(MOE, device="cpu", **OPTIONS)
    for inputs in (sampled, free):
        trainer = [
            *model.forward_only(inputs[:2], adapter_name="moe").logps,
            *base.forward_only(inputs[2:]).logps,
        ]
        for sequence, logps, feature in zip(sequences, trainer, inputs, strict=True):
            expected = logps[torch.tensor(feature["labels"]) != IGNORE_INDEX]
            assert torch.allclose(torch.tensor(sequence.logprobs, dtype=torch.float64), expected, atol=1e-5)


def test_what_expert_lora_cannot_compute_is_refused():
    model = MultiLoraModel(MOE, device="cpu", **OPTIONS)
    with pytest.raises(ConfigurationError, match="lora_dropout must be 0 with LoRA on parameters"):
        model.add_adapter_to_model("dropout", LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.1))
    with pytest.raises(ConfigurationError, match="1-D parameter 'weight'"):
        model.add_adapter_to_model(
            "norm", LoraConfig(r=2, target_modules=[], target_parameters=["input_layernorm.weight"])
        )
    with pytest.raises(ConfigurationError, match="gate_proj without also targeting up_proj"):
        model.add_adapter_to_model("half", LoraConfig(r=2, target_modules=["q_proj", "gate_proj"]))
    assert adapter_names(model.model) == []
