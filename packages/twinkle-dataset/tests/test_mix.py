"""Several sources: per-source preprocessing, then concat or interleave."""

from __future__ import annotations

import pytest

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, InvalidInputError


def _chat(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def _two_sources() -> Dataset:
    dataset = Dataset(DatasetMeta(data=[{"q": f"a{i}"} for i in range(3)]))
    dataset.add_dataset(DatasetMeta(data=[{"prompt": f"b{i}"} for i in range(6)]))
    return dataset


def _contents(dataset: Dataset) -> list[str]:
    return [row["messages"][0]["content"] for row in dataset]


def test_each_source_gets_its_own_preprocessor_then_concat():
    dataset = _two_sources()
    dataset.map(lambda row: _chat(row["q"]), source=0)
    dataset.map(lambda row: _chat(row["prompt"]), source=1)
    dataset.mix("concat")
    assert _contents(dataset) == ["a0", "a1", "a2", "b0", "b1", "b2", "b3", "b4", "b5"]


def test_interleave_round_robin_and_weighted():
    dataset = _two_sources()
    dataset.map(lambda row: _chat(row.get("q") or row["prompt"]))  # every source
    dataset.mix("interleave")
    assert _contents(dataset) == ["a0", "b0", "a1", "b1", "a2", "b2"]  # stops when the first source runs out

    def weighted(seed: int) -> list[str]:
        mixed = _two_sources()
        mixed.map(lambda row: _chat(row.get("q") or row["prompt"]))
        mixed.mix("interleave", probabilities=[0.2, 0.8], seed=seed, stopping_strategy="all_exhausted")
        return _contents(mixed)

    first = weighted(0)
    assert first == weighted(0)  # reproducible from the seed
    assert {"a0", "a1", "a2", "b0", "b5"} <= set(first)


def test_sources_can_be_named_by_id(tmp_path, load_kwargs, write_jsonl):
    path = str(write_jsonl([{"q": "file"}]))
    dataset = Dataset(DatasetMeta(data=[{"q": "memory"}]), **load_kwargs)
    dataset.add_dataset(path)
    dataset.map(lambda row: _chat(row["q"].upper()), source=path)
    dataset.map(lambda row: _chat(row["q"]), source=0)
    dataset.mix()
    assert _contents(dataset) == ["memory", "FILE"]
    with pytest.raises(ConfigurationError, match="no added dataset 'other'"):
        dataset.map(lambda row: row, source="other")


def test_reading_before_mix_and_mismatched_columns_are_errors():
    dataset = _two_sources()
    with pytest.raises(ConfigurationError, match=r"holds 2 datasets.*call mix\(\)"):
        len(dataset)
    with pytest.raises(InvalidInputError, match=r"columns differ.*'q'.*'prompt'"):
        dataset.mix("concat")


def test_bad_mix_arguments():
    dataset = _two_sources()
    dataset.map(lambda row: _chat("x"))
    with pytest.raises(ConfigurationError, match="unknown mix strategy 'zip'"):
        dataset.mix("zip")
    with pytest.raises(ConfigurationError, match="only to strategy='interleave'"):
        dataset.mix("concat", probabilities=[0.5, 0.5])
    with pytest.raises(ConfigurationError, match="got 3 probabilities for 2 datasets"):
        dataset.mix("interleave", probabilities=[0.2, 0.3, 0.5])
    with pytest.raises(ConfigurationError, match="sum to 1"):
        dataset.mix("interleave", probabilities=[0.2, 0.3])


def test_add_dataset_takes_another_datasets_sources():
    left = Dataset(DatasetMeta(data=[{"x": 1}]))
    left.add_dataset(Dataset(DatasetMeta(data=[{"x": 2}, {"x": 3}])))
    left.mix()
    assert [row["x"] for row in left] == [1, 2, 3]
