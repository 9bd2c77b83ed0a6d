"""MultiLoraModel on builtin://qwen3-vl-tiny: image and text tenants in shared passes, LoRA on the vision tower too.

Each tenant's adapter targets ``"all-linear"`` (the vision tower, its mergers and the language model), so in a
shared pass each image's patches must take the adapter of the row the image belongs to. Every run is float64,
so shared and solo runs agree to round-off on any CPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForImageTextToText

from twinkle.hub import resolve_dataset
from twinkle.model import MultiLoraModel

MODEL = "builtin://qwen3-vl-tiny"
TENANTS = {"scene": 4, "chat": 2, "mixed": 3}  # adapter name -> rank


@pytest.fixture(scope="module")
def tenant_features():
    """``scene``: image questions; ``chat``: text only; ``mixed``: a text row between two image rows."""
    from twinkle.template import Template

    template = Template(MODEL, max_length=None)
    with open(os.path.join(resolve_dataset("builtin://clevr-mini"), "train.jsonl"), encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle][:5]

    def text(question, answer, images=()):
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return template.encode({"messages": messages, "images": list(images)} if images else {"messages": messages})

    def image(row):
        return text("<image>" + row["question"], row["answer"], [row["image"]])

    return {
        "scene": [image(row) for row in rows[:3]],
        "chat": [text("Name a color.", "Red."), text("Count to three.", "One, two, three.")],
        "mixed": [image(rows[3]), text("Which shape rolls?", "A sphere."), image(rows[4])],
    }


def _train(features, tenants, steps=2):
    """Every adapter created in the same order (same initial draws); ``tenants`` train ``steps`` shared passes."""
    torch.manual_seed(0)
    model = MultiLoraModel(model_id=MODEL, device="cpu", dtype=torch.float64)
    for name, rank in TENANTS.items():
        model.add_adapter_to_model(name, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
        model.set_optimizer("AdamW", lr=1e-2, adapter_name=name)
    losses = {name: [] for name in tenants}
    for _ in range(steps):
        results = model.forward_backward_many([{"adapter_name": name, "inputs": features[name]} for name in tenants])
        assert [result.error for result in results] == [None] * len(tenants)
        for name in tenants:
            model.clip_grad_and_step(adapter_name=name)
            losses[name].append(model.calculate_metric(is_training=True, adapter_name=name)["loss"])
    return model, losses


def test_image_and_text_tenants_in_shared_passes_equal_their_solo_runs(tenant_features):
    shared, shared_losses = _train(tenant_features, list(TENANTS))
    for name in TENANTS:
        solo, solo_losses = _train(tenant_features, [name])
        assert shared_losses[name] == pytest.approx(solo_losses[name], abs=1e-8)
        ours = shared.adapter_state_dict(shared.train_state(name))
        theirs = solo.adapter_state_dict(solo.train_state(name))
        assert ours.keys() == theirs.keys() and any(".visual." in key for key in ours)
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], atol=1e-8, rtol=1e-8)
        vision_B = [key for key in ours if ".visual." in key and "lora_B" in key]
        trained = any(ours[key].abs().max() > 0 for key in vision_B)
        assert trained == (name != "chat")  # a tenant's tower adapter trains on its own images only


def test_a_vision_tower_adapter_loads_in_plain_peft_with_equal_logits(tenant_features, tmp_path):
    model, _ = _train(tenant_features, ["mixed", "scene"])
    path = model.save("scene-ckpt", output_dir=tmp_path, adapter_name="scene")
    ours = model.forward_only(inputs=tenant_features["mixed"], adapter_name="scene", return_logits=True).logits
    base = AutoModelForImageTextToText.from_pretrained(model.model_path, dtype=torch.float64)
    plain = PeftModel.from_pretrained(base, path).eval()
    for feature, logits in zip(tenant_features["mixed"], ours, strict=True):
        inputs = {"input_ids": torch.tensor([feature["input_ids"]])}
        if "pixel_values" in feature:
            inputs |= {
                "pixel_values": torch.tensor(feature["pixel_values"], dtype=torch.float64),
                "image_grid_thw": torch.tensor(feature["image_grid_thw"]),
                "mm_token_type_ids": torch.tensor([feature["mm_token_type_ids"]]),
            }
        with torch.no_grad():
            reference = plain(**inputs).logits[0]
        torch.testing.assert_close(logits, reference, atol=1e-6, rtol=0)
