"""The cookbook flow with the real components: builtin data → SelfCognitionProcessor → Template → encode."""

from __future__ import annotations

import pytest

from twinkle.data_format import IGNORE_INDEX
from twinkle.dataset import Dataset, DatasetMeta

preprocessor = pytest.importorskip("twinkle.preprocessor", reason="needs twinkle-preprocessor installed")
pytest.importorskip("twinkle.template", reason="needs twinkle-template installed")


def test_self_cognition_cookbook_flow(load_kwargs):
    dataset = Dataset(DatasetMeta("builtin://self-cognition", data_slice=range(500)), **load_kwargs)
    dataset.set_template("Template", model_id="builtin://qwen3-tiny", max_length=256)
    dataset.map(preprocessor.SelfCognitionProcessor("twinkle模型", "twinkle团队"), load_from_cache_file=False)
    dataset.encode(batched=True, load_from_cache_file=False)

    tokenizer = dataset.template.tokenizer
    assert len(dataset) > 50
    for feature in dataset:
        assistant = [m["content"] for m in feature["messages"] if m["role"] == "assistant"]
        labelled = tokenizer.decode(
            [t for t, label in zip(feature["input_ids"], feature["labels"], strict=True) if label != IGNORE_INDEX]
        )
        assert labelled.endswith(assistant[-1] + "<|im_end|>")
        assert "{{NAME}}" not in labelled and "<|im_start|>" not in labelled
    assert any("twinkle模型" in m["content"] for feature in dataset for m in feature["messages"])
