"""Collating image rows (builtin://qwen3-vl-tiny): a padded batch gives each row the logits it gets alone."""

from __future__ import annotations

import pytest
import torch

from twinkle.errors import InvalidInputError
from twinkle.processor import InputProcessor, model_inputs, unpack


@pytest.fixture(scope="module")
def vl_dir() -> str:
    from twinkle.hub import resolve_model

    return resolve_model("builtin://qwen3-vl-tiny")


@pytest.fixture(scope="module")
def vl_model(vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def image_features(vl_dir):
    """Two rows with one and two images of different sizes, and a text-only row, of different lengths."""
    from PIL import Image

    from twinkle.template import Template

    template = Template(vl_dir, max_length=None)
    red, blue = Image.new("RGB", (64, 64), (220, 40, 40)), Image.new("RGB", (96, 64), (40, 80, 220))
    rows = [
        {"messages": [{"role": "user", "content": "<image>Color?"}, {"role": "assistant", "content": "red"}]},
        {
            "messages": [
                {"role": "user", "content": "Compare <image> with <image>, please."},
                {"role": "assistant", "content": "The first is red, the second blue."},
            ]
        },
        {"messages": [{"role": "user", "content": "No image here."}, {"role": "assistant", "content": "Fine."}]},
    ]
    images = [[red], [red, blue], []]
    return [template.encode({**row, "images": row_images}) for row, row_images in zip(rows, images, strict=True)]


def _alone(model, feature) -> torch.Tensor:
    inputs = {"input_ids": torch.tensor([feature["input_ids"]])}
    if feature.get("pixel_values") is not None:
        inputs["pixel_values"] = torch.tensor(feature["pixel_values"])
        inputs["image_grid_thw"] = torch.tensor(feature["image_grid_thw"])
        inputs["mm_token_type_ids"] = torch.tensor([feature["mm_token_type_ids"]])
    with torch.no_grad():
        return model(**inputs).logits[0]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_padded_image_batch_gives_each_row_its_own_logits(vl_model, image_features, padding_side):
    batch = InputProcessor(padding_side=padding_side, pad_token_id=151643)(image_features)
    assert batch["pixel_values"].shape == (16 + 16 + 24, 1536) and batch["pixel_values"].dtype == torch.float32
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4], [1, 4, 6]]
    assert batch["mm_token_type_ids"].sum(1).tolist() == [4, 10, 0]
    inputs = model_inputs(batch)
    assert "position_ids" not in inputs  # the model computes its multimodal (M-RoPE) positions
    with torch.no_grad():
        logits = unpack(vl_model(**inputs).logits, batch)
    for got, feature in zip(logits, image_features, strict=True):
        torch.testing.assert_close(got, _alone(vl_model, feature), atol=1e-5, rtol=0)


def test_padding_free_image_batch_with_the_models_positions_gives_each_row_its_own_logits(vl_model, image_features):
    batch = InputProcessor(padding_free=True)(image_features)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    types = [f.get("mm_token_type_ids") or [0] * len(f["input_ids"]) for f in image_features]  # text row: none
    assert batch["mm_token_type_ids"][0].tolist() == [t for row in types for t in row]
    with pytest.raises(InvalidInputError, match="a padding-free batch with images needs the model's multimodal"):
        model_inputs(batch)
    # Each sequence positioned by the model alone: its text positions, then its M-RoPE rows.
    mrope = [
        vl_model.model.get_rope_index(
            torch.tensor([f["input_ids"]]),
            mm_token_type_ids=torch.tensor([row]),
            image_grid_thw=torch.tensor(f["image_grid_thw"]) if f.get("image_grid_thw") else None,
        )[0]
        for f, row in zip(image_features, types, strict=True)
    ]
    positions = torch.cat([batch["position_ids"].unsqueeze(0), torch.cat(mrope, dim=2)])
    with torch.no_grad():
        logits = unpack(vl_model(**model_inputs(batch, positions)).logits, batch)
    for got, feature in zip(logits, image_features, strict=True):
        torch.testing.assert_close(got, _alone(vl_model, feature), atol=1e-5, rtol=0)


def test_inconsistent_image_rows_are_refused(image_features):
    broken = {**image_features[0], "image_grid_thw": [[1, 4, 6]]}
    with pytest.raises(InvalidInputError, match=r"features\[0\].pixel_values has shape \(16, 1536\) but its"):
        InputProcessor()([broken])
