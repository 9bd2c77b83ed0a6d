"""encode and rows with no supervised token: an error when none is supervised, else a warning or a drop."""

from __future__ import annotations

import logging
from typing import Any

import datasets
import pytest

from twinkle.data_format import IGNORE_INDEX
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.dataset.supervision import unsupervised_rows
from twinkle.errors import ConfigurationError
from twinkle.registry import build

pytest.importorskip("twinkle.template", reason="encode tests need twinkle-template installed")

MODEL_ID = "builtin://qwen3-tiny"
NO = IGNORE_INDEX


def prompt_only(row: dict[str, Any]) -> dict[str, Any]:
    """A prompt-only preprocessor, as GSM8KProcessor() without include_solution=True."""
    return {"messages": [{"role": "user", "content": row["query"]}]}


def _dataset(load_kwargs, preprocessor, rows: int = 16) -> Dataset:
    dataset = Dataset(DatasetMeta("builtin://self-cognition", data_slice=range(rows)), **load_kwargs)
    dataset.map(preprocessor)
    return dataset


def test_unsupervised_rows_reads_labels_else_the_loss_mask_and_ignores_the_first_position():
    labels = datasets.Dataset.from_dict({"labels": [[NO, NO, 3], [5, NO, NO], [NO, 1], [NO, NO]]})
    assert unsupervised_rows(labels) == [1, 3]  # row 1's only label is on the first token, which nothing predicts
    assert unsupervised_rows(labels.select([3, 0, 1])) == [0, 2]  # positions in the selection's order
    masks = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4]], "loss_mask": [[0, 1], [1, 0]]})
    assert unsupervised_rows(masks) == [1]
    assert unsupervised_rows(datasets.Dataset.from_dict({"input_ids": [[1, 2]]})) == [0]  # neither column


def test_a_dataset_with_no_supervised_row_is_an_error_naming_the_preprocessor(load_kwargs):
    dataset = _dataset(load_kwargs, prompt_only)
    dataset.set_template("Template", model_id=MODEL_ID)

    with pytest.raises(ConfigurationError) as info:
        dataset.encode()

    message = str(info.value)
    assert "builtin://self-cognition: none of its 16 rows has a supervised token" in message
    assert "after map(prompt_only)" in message and "encode(add_generation_prompt=True)" in message
    assert "input_ids" not in dataset.column_names  # unchanged, so a corrected encode can follow
    dataset.encode(add_generation_prompt=True)  # prompts for sampling: nothing to supervise, by design
    assert len(dataset) == 16


def _truncated_answers(load_kwargs, self_cognition_fn) -> tuple[Dataset, int, list[int]]:
    """Self-cognition rows under right truncation at a length that cuts some answers off entirely; the
    length and, encoded one by one, which rows lose every supervised token."""
    dataset = _dataset(load_kwargs, self_cognition_fn)
    full = build("template", "Template", model_id=MODEL_ID)
    encoded = [full.encode(row) for row in dataset]
    # A row loses every supervised token when its first labelled position is max_length or later.
    max_length = max(next(i for i, x in enumerate(feature["labels"]) if x != NO) for feature in encoded)
    cut = build("template", "Template", model_id=MODEL_ID, max_length=max_length, truncation_strategy="right")
    expected = [i for i, row in enumerate(dataset) if all(x == NO for x in cut.encode(row)["labels"][1:])]
    assert 0 < len(expected) < len(dataset)
    dataset.set_template(cut)
    return dataset, max_length, expected


def test_some_unsupervised_rows_are_kept_with_a_warning_that_counts_them(load_kwargs, self_cognition_fn, caplog):
    dataset, max_length, expected = _truncated_answers(load_kwargs, self_cognition_fn)

    with caplog.at_level(logging.WARNING, logger="twinkle"):
        dataset.encode()

    assert len(dataset) == 16
    assert unsupervised_rows(dataset.to_hf()) == expected
    rows = ", ".join(map(str, expected[:10])) + (", ..." if len(expected) > 10 else "")
    assert f"{len(expected)} of 16 rows have no supervised token (rows {rows}) after map(self_cognition)" in caplog.text
    assert f"max_length={max_length}, truncation_strategy='right'" in caplog.text
    assert "encode(drop_unsupervised=True)" in caplog.text


def test_drop_unsupervised_keeps_exactly_the_supervised_rows(load_kwargs, self_cognition_fn, caplog):
    dataset, _, expected = _truncated_answers(load_kwargs, self_cognition_fn)
    queries = [row["messages"][0]["content"] for row in dataset]

    with caplog.at_level(logging.INFO, logger="twinkle"):
        dataset.encode(drop_unsupervised=True)

    assert [row["messages"][0]["content"] for row in dataset] == [q for i, q in enumerate(queries) if i not in expected]
    assert unsupervised_rows(dataset.to_hf()) == []
    assert f"dropped {len(expected)} of 16 rows with no supervised token" in caplog.text
    assert "have no supervised token" not in caplog.text  # no warning about rows that are gone


def test_generation_prompts_are_not_reported(load_kwargs, self_cognition_fn, caplog):
    dataset = _dataset(load_kwargs, self_cognition_fn, rows=4)
    dataset.set_template("Template", model_id=MODEL_ID)

    with caplog.at_level(logging.WARNING, logger="twinkle"):
        dataset.encode(add_generation_prompt=True)

    assert "supervised" not in caplog.text
