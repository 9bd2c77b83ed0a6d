"""Every embedded model family through the whole stack, as a user fine-tuning that family would use it.

For ``builtin://llama-tiny``, ``qwen2-tiny``, ``qwen3-moe-tiny`` and ``glm4-tiny``: LoRA SFT lowers the
loss and the saved adapter loads in plain transformers + PEFT with the trainer's logits; a full-parameter
step saves a directory plain transformers loads with the same logits; ``MultiLoraModel`` trains two
adapters in one pass and its saved adapter loads in PEFT too; ``TorchSampler`` reports the log-probs the
trainer computes for what it sampled. "all-linear" adapts every linear layer but the output layer, and on
the MoE family, as PEFT resolves it there, each layer's fused experts and its router too. Everything runs
in float64: the mixture-of-experts router picks its
top-2 experts per token, and float32 round-off that differs between two correct implementations could flip
a near tie and change a logit by far more than any tolerance, on some CPUs and not others.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.hub import resolve_model
from twinkle.model import AdapterRequest, MultiLoraModel, TransformersModel
from twinkle.sampler import TorchSampler

sys.path.insert(0, str(Path(__file__).parent))
from conversations import encoded_conversations

FAMILIES = ["builtin://llama-tiny", "builtin://qwen2-tiny", "builtin://qwen3-moe-tiny", "builtin://glm4-tiny"]
DTYPE = torch.float64
TOL = {"atol": 1e-5, "rtol": 1e-5}

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda model_id: model_id.removeprefix("builtin://"))
def family(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    model_id = request.param
    return model_id, encoded_conversations(model_id)


def _logits(model: Any, features: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Plain transformers logits of each feature alone."""
    with torch.no_grad():
        return [model(torch.tensor([f["input_ids"]])).logits[0] for f in features]


def _assert_same_logits(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a.to(DTYPE), b.to(DTYPE), **TOL), (a - b).abs().max()


def _prompt(feature: dict[str, Any]) -> list[int]:
    """The tokens before the first supervised one (the user turn and the assistant header)."""
    first = next(index for index, label in enumerate(feature["labels"]) if label != IGNORE_INDEX)
    return list(feature["input_ids"][:first])


def _options(model_id: str) -> dict[str, Any]:
    """float64, and for MoE the eager expert loop: torch's grouped matmul (the default) takes no float64."""
    return {"dtype": DTYPE, **({"experts_implementation": "eager"} if "moe" in model_id else {})}


def _plain(model_id: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(resolve_model(model_id), **_options(model_id))


def test_lora_sft_lowers_the_loss_the_adapter_loads_in_peft_and_samples_trainer_logprobs(family, tmp_path: Path):
    model_id, features = family
    model = TransformersModel(model_id, device="cpu", **_options(model_id))
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    model.add_adapter_to_model("default", config, seed=0)
    model.set_optimizer("AdamW", lr=2e-2)
    losses = []
    for _ in range(5):
        losses.append(model.forward_backward(features).loss)
        model.clip_grad_and_step()
    assert losses[-1] < losses[0] - 0.5, losses
    path = model.save("lora", output_dir=tmp_path)
    peft = PeftModel.from_pretrained(_plain(model_id), path).eval()
    _assert_same_logits(model.forward_only(features, return_logits=True).logits, _logits(peft, features))

    sampler = TorchSampler(model_id, device="cpu", **_options(model_id))
    sampler.load_adapter("sft", path)
    prompts = [{"input_ids": _prompt(feature)} for feature in features]
    response = sampler.sample(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=0), adapter_name="sft")
    sequences = response.sequences
    trainer = model.forward_only([s.new_input_feature for s in sequences])
    for sequence, logps, feature in zip(
        sequences, trainer.logps, [s.new_input_feature for s in sequences], strict=True
    ):
        expected = logps[torch.tensor(feature["labels"]) != IGNORE_INDEX]
        assert torch.allclose(torch.tensor(sequence.logprobs, dtype=DTYPE), expected.to(DTYPE), **TOL)


def test_a_full_parameter_step_saves_what_plain_transformers_loads(family, tmp_path: Path):
    model_id, features = family
    model = TransformersModel(model_id, device="cpu", **_options(model_id))
    model.set_optimizer("AdamW", lr=1e-3)
    model.forward_backward(features)
    model.clip_grad_and_step()
    path = model.save("full", output_dir=tmp_path, save_optimizer=False)
    reloaded = AutoModelForCausalLM.from_pretrained(path, **_options(model_id)).eval()
    _assert_same_logits(model.forward_only(features, return_logits=True).logits, _logits(reloaded, features))
    untrained = _logits(_plain(model_id).eval(), features[:1])[0]
    assert not torch.allclose(_logits(reloaded, features[:1])[0], untrained, **TOL)  # the step was saved


def test_multi_lora_trains_two_adapters_in_one_pass_and_each_loads_in_peft(family, tmp_path: Path):
    model_id, features = family
    model = MultiLoraModel(model_id, device="cpu", **_options(model_id))
    model.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), seed=1)
    model.add_adapter_to_model("b", LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"]), seed=2)
    for name in ("a", "b"):
        model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
    results = model.forward_backward_many([AdapterRequest("a", features[:2]), AdapterRequest("b", features[2:])])
    assert all(result.error is None for result in results), [result.error for result in results]
    for name in ("a", "b"):
        model.clip_grad_and_step(adapter_name=name)
        path = model.save(name, output_dir=tmp_path, adapter_name=name)
        peft = PeftModel.from_pretrained(_plain(model_id), path).eval()
        logits = model.forward_only(features, adapter_name=name, return_logits=True).logits
        _assert_same_logits(logits, _logits(peft, features))
