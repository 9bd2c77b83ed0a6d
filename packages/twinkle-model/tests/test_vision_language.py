"""Training builtin://qwen3-vl-tiny on image questions: LoRA (language model, optionally vision too) and full."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForImageTextToText

from twinkle.hub import resolve_dataset
from twinkle.model import TransformersModel

MODEL = "builtin://qwen3-vl-tiny"
# LoRA on the language model only: PEFT matches these names under model.language_model, never the ViT's.
LANGUAGE_ONLY = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@pytest.fixture(scope="module")
def clevr_features():
    from twinkle.template import Template

    template = Template(MODEL, max_length=None)
    with open(os.path.join(resolve_dataset("builtin://clevr-mini"), "train.jsonl"), encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle][:12]
    return [
        template.encode(
            {
                "messages": [
                    {"role": "user", "content": "<image>" + row["question"]},
                    {"role": "assistant", "content": row["answer"]},
                ],
                "images": [row["image"]],
            }
        )
        for row in rows
    ]


def _train(features, lora: LoraConfig | None, steps: int, lr: float) -> tuple[TransformersModel, list[float]]:
    torch.manual_seed(0)
    model = TransformersModel(model_id=MODEL, device="cpu")
    if lora is not None:
        model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=lr)
    losses = []
    for _ in range(steps):
        model.forward_backward(inputs=features[:8])
        model.clip_grad_and_step()
        losses.append(model.calculate_metric(is_training=True)["loss"])
    return model, losses


def _reference_logits(plain, feature) -> torch.Tensor:
    with torch.no_grad():
        return plain(
            input_ids=torch.tensor([feature["input_ids"]]),
            pixel_values=torch.tensor(feature["pixel_values"], dtype=torch.float32),
            image_grid_thw=torch.tensor(feature["image_grid_thw"]),
            mm_token_type_ids=torch.tensor([feature["mm_token_type_ids"]]),
        ).logits[0]


@pytest.mark.parametrize("targets", [LANGUAGE_ONLY, "all-linear"], ids=["language-only", "with-vision"])
def test_saved_adapter_gives_equal_logits_in_plain_peft(clevr_features, targets, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    model, _ = _train(clevr_features, lora, steps=3, lr=1e-2)
    adapted = {name for name, _ in model.model.named_parameters() if "lora_A" in name}
    assert any("language_model" in name for name in adapted)
    assert any(".visual." in name for name in adapted) == (targets == "all-linear")
    path = model.save("ckpt", output_dir=tmp_path)
    ours = model.forward_only(inputs=clevr_features[8:10], return_logits=True)

    base = AutoModelForImageTextToText.from_pretrained(model.model_path, dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, path).eval()
    for feature, logits in zip(clevr_features[8:10], ours.logits, strict=True):
        reference = _reference_logits(plain, feature)
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    base_logits = _reference_logits(AutoModelForImageTextToText.from_pretrained(model.model_path), clevr_features[8])
    assert (base_logits - ours.logits[0]).abs().max() > 1e-3  # the adapter changed the image prompt's logits


def test_full_parameter_training_lowers_the_loss_and_trains_the_vision_tower(clevr_features):
    model, losses = _train(clevr_features, None, steps=4, lr=1e-3)
    assert losses[-1] < losses[0] - 1.0, losses
    trained = model.model.model.visual.blocks[0].attn.qkv.weight
    original = AutoModelForImageTextToText.from_pretrained(model.model_path).model.visual.blocks[0].attn.qkv.weight
    assert not torch.equal(trained.detach(), original.detach())


def test_lora_sft_lowers_the_loss(clevr_features):
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=LANGUAGE_ONLY, lora_dropout=0.0)
    _, losses = _train(clevr_features, lora, steps=5, lr=5e-3)
    assert losses[-1] < losses[0] - 2.0, losses


def test_padding_free_image_batches_equal_padded_ones(clevr_features):
    from twinkle.processor import InputProcessor
    from twinkle.template import Template

    text = [{"role": "user", "content": "How many objects?"}, {"role": "assistant", "content": "Show me."}]
    features = [*clevr_features[:3], Template(MODEL, max_length=None).encode({"messages": text})]  # one text-only
    results = {}
    for padding_free in (False, True):
        torch.manual_seed(0)
        model = TransformersModel(model_id=MODEL, device="cpu")
        model.set_processor(InputProcessor(padding_free=padding_free))
        model.set_optimizer("SGD", lr=0.1)
        before = model.forward_only(inputs=features).logps
        model.forward_backward(inputs=features)
        model.clip_grad_and_step()
        results[padding_free] = (before, model.calculate_metric(is_training=True)["loss"])
        results[padding_free] += (model.forward_only(inputs=features).logps,)
    for padded, packed in zip(results[False][0] + results[False][2], results[True][0] + results[True][2], strict=True):
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=0)
    assert results[True][1] == pytest.approx(results[False][1], abs=1e-5)
