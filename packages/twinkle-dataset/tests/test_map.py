"""map/filter/shuffle/select: rows become trajectories, bad rows are reported, results are cached."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from twinkle.dataset import DataProcessingError, Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.registry import register


def _reject_odd(row):
    if row["i"] % 2:
        raise InvalidInputError(f"odd number {row['i']}")
    return {"messages": [{"role": "user", "content": str(row["i"])}]}


def _numbers(n: int) -> Dataset:
    return Dataset(DatasetMeta(data=[{"i": i} for i in range(n)]))


def test_map_turns_builtin_rows_into_trajectories(load_kwargs, self_cognition_fn):
    dataset = Dataset(DatasetMeta("builtin://self-cognition"), **load_kwargs)
    num_rows = len(dataset)

    dataset.map(self_cognition_fn)

    assert len(dataset) == num_rows
    assert dataset.column_names == ["messages", "user_data"]
    first = dataset[0]
    assert [m["role"] for m in first["messages"]] == ["user", "assistant"]
    assert all("{{" not in m["content"] for row in dataset for m in row["messages"])
    assert first["user_data"]["tag"] in {"en", "zh"}


def test_rejected_rows_are_listed_by_index_after_the_pass():
    dataset = _numbers(30)
    with pytest.raises(DataProcessingError) as info:
        dataset.map(_reject_odd)
    error = info.value
    assert error.num_bad == 15
    assert [index for index, _ in error.bad_rows] == [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]
    assert error.bad_rows[0][1] == "odd number 1"
    assert "15 of 30 rows are invalid (first 10 shown)" in str(error)
    assert "row 3: odd number 3" in str(error)
    assert isinstance(error, InvalidInputError)
    assert len(dataset) == 30 and dataset.column_names == ["i"]  # a failed map changes nothing


def test_strict_false_drops_rejected_rows_with_a_warning(caplog):
    dataset = _numbers(6)
    with caplog.at_level(logging.WARNING, logger="twinkle"):
        dataset.map(_reject_odd, strict=False)
    assert [row["messages"][0]["content"] for row in dataset] == ["0", "2", "4"]
    assert "dropped 3 of 6 invalid rows" in caplog.text
    assert "row 1: odd number 1" in caplog.text


def test_returning_none_drops_a_row_on_purpose():
    dataset = _numbers(5)
    dataset.map(lambda row: None if row["i"] == 2 else {"j": row["i"] * 10})
    assert [row["j"] for row in dataset] == [0, 10, 30, 40]


def test_invalid_outputs_are_reported_like_rejected_rows():
    with pytest.raises(DataProcessingError, match=r"row 0: preprocessor output.messages\[0\].role"):
        _numbers(2).map(lambda row: {"messages": [{"role": "robot", "content": "hi"}]})
    with pytest.raises(DataProcessingError, match="row 0: the row function returned list"):
        _numbers(2).map(lambda row: [row])
    with pytest.raises(DataProcessingError, match="not JSON-serialisable"):
        _numbers(2).map(lambda row: {"value": object()})


def test_nested_values_round_trip_exactly():
    """Keys that vary by row, mixed types and JSON-looking strings come back as they went in."""
    outputs = [
        {"user_data": {"answer": "42"}, "note": "null"},
        {"user_data": {"answer": 42, "extra": [1, {"k": None}]}, "note": "true"},
        {"user_data": {}, "note": None},
    ]
    dataset = Dataset(DatasetMeta(data=[{"i": i} for i in range(3)]))
    dataset.map(lambda row: outputs[row["i"]], batch_size=1)
    assert list(dataset) == outputs


def test_preprocessor_by_class_instance_and_registered_name():
    class Double(Preprocessor):
        def preprocess(self, row):
            return {"i": row["i"] * 2}

    register("preprocessor", Double, name="TestDouble")
    dataset = _numbers(3)
    dataset.map(Double())
    dataset.map(Double)
    dataset.map("TestDouble")
    assert [row["i"] for row in dataset] == [0, 8, 16]


def test_map_runs_in_worker_processes():
    dataset = _numbers(40)
    dataset.map(_reject_odd, strict=False, num_proc=2)
    assert len(dataset) == 20


def test_unknown_map_option_is_rejected():
    with pytest.raises(ConfigurationError, match=r"unknown map option\(s\) \['remove_columns'\]"):
        _numbers(2).map(lambda row: row, remove_columns=["i"])


def _counting_preprocessor(log: Path):
    def preprocess(row):
        with log.open("a") as file:
            file.write(".")
        return {"messages": [{"role": "user", "content": row["query"]}]}

    return preprocess


def test_file_backed_map_is_cached_by_fingerprint(tmp_path, load_kwargs, write_jsonl):
    path = write_jsonl([{"query": f"q{i}"} for i in range(20)])
    calls = tmp_path / "calls.txt"

    first = Dataset(DatasetMeta(str(path)), **load_kwargs)
    first.map(_counting_preprocessor(calls))
    assert calls.read_text() == "." * 20

    second = Dataset(DatasetMeta(str(path)), **load_kwargs)
    second.map(_counting_preprocessor(calls))
    assert calls.read_text() == "." * 20  # same data and function: the cached result is reused
    assert second.to_hf().cache_files == first.to_hf().cache_files
    assert list(second) == list(first)

    third = Dataset(DatasetMeta(str(path)), **load_kwargs)
    third.map(_counting_preprocessor(calls), load_from_cache_file=False)
    assert calls.read_text() == "." * 40


def test_cached_rejections_are_still_reported(tmp_path, load_kwargs, write_jsonl):
    path = write_jsonl([{"i": i} for i in range(4)])
    for _ in range(2):
        with pytest.raises(DataProcessingError, match="2 of 4 rows are invalid"):
            Dataset(DatasetMeta(str(path)), **load_kwargs).map(_reject_odd)


def test_filter_shuffle_select():
    dataset = _numbers(10)
    dataset.filter(lambda row: row["i"] % 3 == 0)
    assert [row["i"] for row in dataset] == [0, 3, 6, 9]

    dataset.shuffle(seed=1)
    order = [row["i"] for row in dataset]
    again = _numbers(10)
    again.filter(lambda row: row["i"] % 3 == 0)
    again.shuffle(seed=1)
    assert sorted(order) == [0, 3, 6, 9] and [row["i"] for row in again] == order

    dataset.select([3, 0])
    assert [row["i"] for row in dataset] == [order[3], order[0]]
    with pytest.raises(InvalidInputError, match=r"outside \[0, 2\).*\[2\]"):
        dataset.select([2])


def test_indexing_errors():
    dataset = _numbers(3)
    assert dataset.__getitems__([2, 0]) == [{"i": 2}, {"i": 0}]
    with pytest.raises(IndexError, match="row 3 is out of range for a dataset of 3 rows"):
        dataset[3]
    with pytest.raises(InvalidInputError, match="indexed by int"):
        dataset["i"]


def test_dropping_every_row_leaves_an_empty_dataset_that_still_maps():
    dataset = _numbers(4)
    dataset.map(lambda row: None)
    assert len(dataset) == 0
    dataset.map(lambda row: {"never": "called"})
    assert len(dataset) == 0 and list(dataset) == []
