"""TorchSampler on image prompts (builtin://qwen3-vl-tiny): transformers' own generation, and the trainer's
log-probs, for the base model and a LoRA adapter on the language model."""

from __future__ import annotations

import json
import os

import pytest
import torch

from twinkle.data_format import SamplingParams
from twinkle.hub import resolve_dataset

MODEL = "builtin://qwen3-vl-tiny"
LANGUAGE = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@pytest.fixture(scope="module")
def vl_sampler():
    from twinkle.sampler import TorchSampler

    sampler = TorchSampler(MODEL, device="cpu")
    sampler.set_template("Template", max_length=None)
    return sampler


@pytest.fixture(scope="module")
def image_prompts(vl_sampler):
    """Three CLEVR questions, the last two with the same question text (equal tokens) but different images."""
    with open(os.path.join(resolve_dataset("builtin://clevr-mini"), "test.jsonl"), encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    count = [row for row in rows if row["question"] == "How many objects are there?"][:2]
    chosen = [rows[0], *count]
    trajectories = [
        {"messages": [{"role": "user", "content": "<image>" + row["question"]}], "images": [row["image"]]}
        for row in chosen
    ]
    return [vl_sampler.template.encode(trajectory, add_generation_prompt=True) for trajectory in trajectories]


@pytest.fixture(scope="module")
def vl_trained_model():
    """The VL model with a LoRA adapter on the language model whose B is random, so it matters."""
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(model_id=MODEL, device="cpu")
    model.add_adapter_to_model("policy", LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=generator)
    return model


def test_greedy_tokens_equal_transformers_generate(vl_sampler, image_prompts):
    from transformers import AutoModelForImageTextToText

    response = vl_sampler.sample(image_prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [sequence.input_index for sequence in response.sequences] == [0, 1, 2]  # equal tokens, other images
    reference = AutoModelForImageTextToText.from_pretrained(vl_sampler.model_path).eval()
    for prompt, sequence in zip(image_prompts, response.sequences, strict=True):
        with torch.no_grad():
            generated = reference.generate(
                input_ids=torch.tensor([prompt["input_ids"]]),
                pixel_values=torch.tensor(prompt["pixel_values"]),
                image_grid_thw=torch.tensor(prompt["image_grid_thw"]),
                mm_token_type_ids=torch.tensor([prompt["mm_token_type_ids"]]),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
            )
        assert sequence.tokens == generated[0, len(prompt["input_ids"]) :].tolist()


def test_sampled_logprobs_equal_the_trainers(vl_sampler, image_prompts, vl_trained_model, completion_logps):
    from peft import get_peft_model_state_dict

    model = vl_trained_model
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    base = vl_sampler.sample(image_prompts, params, num_samples=2, use_base_model=True)
    with model.model.disable_adapter():
        expected = completion_logps(model, base.sequences)
    for ours, theirs in zip([s.logprobs for s in base.sequences], expected, strict=True):
        assert len(ours) == len(theirs) and max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-5

    lora = (model.model.peft_config["policy"], get_peft_model_state_dict(model.model, adapter_name="policy"))
    vl_sampler.add_adapter("policy", *lora)
    adapted = vl_sampler.sample(image_prompts, params, num_samples=2, adapter_name="policy")
    expected = completion_logps(model, adapted.sequences, adapter_name="policy")
    for ours, theirs in zip([s.logprobs for s in adapted.sequences], expected, strict=True):
        assert len(ours) == len(theirs) and max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-5
    assert any(a.tokens != b.tokens for a, b in zip(adapted.sequences, base.sequences, strict=True))
    vl_sampler.remove_adapter("policy")


def test_an_adapter_on_the_vision_tower_gets_each_rows_patches(
    vl_sampler, image_prompts, vl_trained_model, completion_logps
):
    """A vision-tower adapter and a language-model adapter in one batch: each row's log-probs are the trainer's
    for its own adapter, so each image's patches went through its own row's adapter."""
    from peft import LoraConfig, get_peft_model_state_dict

    model = vl_trained_model
    model.add_adapter_to_model("vision", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B.vision" in name:
                param.normal_(0, 0.3 if ".visual." in name else 0.0, generator=generator)  # only the ViT's matter
    for adapter in ("policy", "vision"):
        state = get_peft_model_state_dict(model.model, adapter_name=adapter)
        vl_sampler.add_adapter(adapter, model.model.peft_config[adapter], state)
    try:
        adapters = ["vision", "policy", "vision"]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=4)
        mixed = vl_sampler.sample(image_prompts, params, adapter_name=adapters)
        for adapter, sequence in zip(adapters, mixed.sequences, strict=True):
            (expected,) = completion_logps(model, [sequence], adapter_name=adapter)
            assert len(sequence.logprobs) == len(expected)
            assert max(abs(a - b) for a, b in zip(sequence.logprobs, expected, strict=True)) <= 1e-5
        with model.model.disable_adapter():
            base = completion_logps(model, [mixed.sequences[0]], adapter_name="vision")[0]
        assert max(abs(a - b) for a, b in zip(mixed.sequences[0].logprobs, base, strict=True)) > 1e-3
    finally:
        for adapter in ("policy", "vision"):
            vl_sampler.remove_adapter(adapter)
        model.model.delete_adapter("vision")


def test_image_prompt_to_a_text_only_sampler_is_refused(image_prompts):
    from twinkle.errors import InvalidInputError
    from twinkle.sampler import TorchSampler

    sampler = TorchSampler("builtin://qwen3-tiny", device="cpu")
    with pytest.raises(InvalidInputError, match=r"inputs\[0\] carry images but the sampler's model takes no images"):
        sampler.sample([image_prompts[0]], SamplingParams(max_tokens=2))
