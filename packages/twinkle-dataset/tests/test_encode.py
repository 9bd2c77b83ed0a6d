"""encode: trajectories become InputFeatures through a template resolved by name; labels cover assistant tokens."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from twinkle.data_format import IGNORE_INDEX, validate_input_feature
from twinkle.dataset import DataProcessingError, Dataset, DatasetMeta
from twinkle.errors import ConfigurationError
from twinkle.registry import build

pytest.importorskip("twinkle.template", reason="encode tests need twinkle-template installed")

MODEL_ID = "builtin://qwen3-tiny"
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build("template", "Template", model_id=MODEL_ID).tokenizer


def _self_cognition_dataset(load_kwargs, self_cognition_fn, rows: int = 16) -> Dataset:
    dataset = Dataset(DatasetMeta("builtin://self-cognition", data_slice=range(rows)), **load_kwargs)
    dataset.map(self_cognition_fn)
    return dataset


def _labelled_text(tokenizer: Any, feature: dict[str, Any]) -> str:
    return tokenizer.decode(
        [token for token, label in zip(feature["input_ids"], feature["labels"], strict=True) if label != IGNORE_INDEX]
    )


def test_encode_labels_only_the_assistant_tokens(load_kwargs, self_cognition_fn, tokenizer):
    dataset = _self_cognition_dataset(load_kwargs, self_cognition_fn)
    dataset.set_template("Template", model_id=MODEL_ID, max_length=2048)

    dataset.encode()

    assert len(dataset) == 16
    for feature in dataset:
        validate_input_feature(feature)
        user, assistant = feature["messages"]
        labelled = _labelled_text(tokenizer, feature)
        assert labelled.removeprefix(EMPTY_THINK) == assistant["content"] + "<|im_end|>"
        assert user["content"] not in labelled
        trained = [label for label, mask in zip(feature["labels"], feature["loss_mask"], strict=True) if mask]
        assert trained == [t for t, m in zip(feature["input_ids"], feature["loss_mask"], strict=True) if m]
        assert feature["user_data"]["tag"] in {"en", "zh"}
    assert dataset.to_hf().features["input_ids"].feature.dtype == "int32"  # token columns stay native Arrow


def test_encode_with_generation_prompt_has_no_labels(load_kwargs, self_cognition_fn, tokenizer):
    dataset = _self_cognition_dataset(load_kwargs, self_cognition_fn, rows=4)
    dataset.set_template("Template", tokenizer=tokenizer)

    dataset.encode(add_generation_prompt=True)

    for feature in dataset:
        assert set(feature["labels"]) == {IGNORE_INDEX}
        text = tokenizer.decode(feature["input_ids"])
        assert text.endswith("<|im_start|>assistant\n")
        assert feature["messages"][1]["role"] == "assistant"  # the reference answer rides along for rewards


def _lengths(tokenizer: Any, dataset: Dataset) -> list[int]:
    full = build("template", "Template", tokenizer=tokenizer, max_length=None)
    return [len(full.encode(row)["input_ids"]) for row in dataset]


def test_rows_deleted_by_truncation_are_counted_in_the_log(load_kwargs, self_cognition_fn, tokenizer, caplog):
    dataset = _self_cognition_dataset(load_kwargs, self_cognition_fn)
    lengths = _lengths(tokenizer, dataset)
    max_length = sorted(lengths)[len(lengths) // 2]
    too_long = sum(length > max_length for length in lengths)
    assert 0 < too_long < len(lengths)
    dataset.set_template("Template", tokenizer=tokenizer, max_length=max_length, truncation_strategy="delete")

    with caplog.at_level(logging.INFO, logger="twinkle"):
        dataset.encode(batched=False)

    assert len(dataset) == len(lengths) - too_long
    assert (
        f"the template deleted {too_long} rows (max_length={max_length}, truncation_strategy='delete')" in caplog.text
    )


def test_rows_the_template_rejects_are_reported_by_index(load_kwargs, self_cognition_fn, tokenizer):
    dataset = _self_cognition_dataset(load_kwargs, self_cognition_fn)
    lengths = _lengths(tokenizer, dataset)
    max_length = max(lengths) - 1
    dataset.set_template("Template", tokenizer=tokenizer, max_length=max_length, truncation_strategy="raise")

    with pytest.raises(DataProcessingError) as info:
        dataset.encode()

    assert [index for index, _ in info.value.bad_rows] == [i for i, n in enumerate(lengths) if n > max_length]


def test_encode_needs_a_template():
    with pytest.raises(ConfigurationError, match="set_template"):
        Dataset(DatasetMeta(data=[{"messages": [{"role": "user", "content": "hi"}]}])).encode()
