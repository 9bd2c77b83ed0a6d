"""encode on an image dataset (builtin://clevr-mini for builtin://qwen3-vl-tiny): image features cached natively."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.registry import build

template_module = pytest.importorskip("twinkle.template", reason="encode tests need twinkle-template installed")
vision = pytest.importorskip("twinkle.template.vision")

MODEL_ID = "builtin://qwen3-vl-tiny"


def test_encode_computes_image_features_once_and_stores_them_as_float32(load_kwargs, monkeypatch):
    decoded: list[int] = []
    real_load_image = vision.load_image

    def counting_load_image(image, where):
        decoded.append(1)
        return real_load_image(image, where)

    monkeypatch.setattr(vision, "load_image", counting_load_image)
    dataset = Dataset(DatasetMeta("builtin://clevr-mini", data_slice=range(6)), **load_kwargs)
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256)
    dataset.map(build("preprocessor", "CLEVRProcessor", include_answer=True))
    dataset.encode()
    assert len(decoded) == 6  # one image per row, decoded by encode

    features = dataset.to_hf().features
    assert str(features["pixel_values"].feature.feature.dtype) == "float32"
    assert str(features["image_grid_thw"].feature.feature.dtype) == "int64"
    template = template_module.Template(MODEL_ID, max_length=256)
    source = Dataset(DatasetMeta("builtin://clevr-mini", data_slice=range(6)), **load_kwargs)
    source.map(build("preprocessor", "CLEVRProcessor", include_answer=True))
    for _epoch in range(2):  # reading rows again (every epoch) decodes no image
        for row, trajectory in zip(dataset, source, strict=True):
            expected = template.encode(trajectory)
            assert row["input_ids"] == expected["input_ids"] and row["labels"] == expected["labels"]
            assert row["mm_token_type_ids"] == expected["mm_token_type_ids"]
            assert row["image_grid_thw"] == expected["image_grid_thw"] == [[1, 4, 4]]
            assert np.array_equal(np.asarray(row["pixel_values"], np.float32), np.asarray(expected["pixel_values"]))
            assert row["user_data"]["answer"] == trajectory["messages"][1]["content"]
    assert len(decoded) == 6 + 2 * 6  # only the reference encodes above decoded images again
