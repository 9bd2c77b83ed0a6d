"""Loading rows: every local format, directories with splits and subsets, hub ids, memory, slices, errors."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import ConfigurationError, InvalidInputError, ResourceNotFoundError

ROWS = [{"query": f"q{i}", "score": i} for i in range(5)]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_each_local_format_loads_the_same_rows(tmp_path, load_kwargs, suffix):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        _write(path, "".join(json.dumps(row) + "\n" for row in ROWS))
    elif suffix == ".json":
        _write(path, json.dumps(ROWS))
    elif suffix == ".csv":
        _write(path, "query,score\n" + "".join(f"{r['query']},{r['score']}\n" for r in ROWS))
    else:
        pq.write_table(pa.Table.from_pylist(ROWS), path)

    dataset = Dataset(DatasetMeta(str(path)), **load_kwargs)

    assert len(dataset) == 5
    assert list(dataset) == ROWS
    assert dataset.column_names == ["query", "score"]


def test_directory_is_split_by_file_name(tmp_path, load_kwargs, write_jsonl):
    write_jsonl([{"x": 1}, {"x": 2}], "data/train-00000-of-00002.jsonl")
    write_jsonl([{"x": 3}], "data/train-00001-of-00002.jsonl")
    write_jsonl([{"x": 9}], "data/test.jsonl")
    (tmp_path / "data" / "README.md").write_text("not data")
    (tmp_path / "data" / "dataset_infos.json").write_text("{}")  # hub metadata, not rows

    train = Dataset(DatasetMeta(str(tmp_path / "data")), **load_kwargs)
    test = Dataset(DatasetMeta(str(tmp_path / "data"), split="test"), **load_kwargs)

    assert [row["x"] for row in train] == [1, 2, 3]
    assert [row["x"] for row in test] == [9]


def test_split_folders_and_unsplit_folders(tmp_path, load_kwargs, write_jsonl):
    write_jsonl([{"x": 1}], "by_folder/validation/part0.jsonl")
    write_jsonl([{"x": 2}], "by_folder/train/part0.jsonl")
    write_jsonl([{"x": 3}], "unsplit/a.jsonl")
    write_jsonl([{"x": 4}], "unsplit/b.jsonl")

    assert [r["x"] for r in Dataset(DatasetMeta(str(tmp_path / "by_folder"), split="validation"), **load_kwargs)] == [1]
    # A folder whose files name no split is all training data.
    assert [r["x"] for r in Dataset(DatasetMeta(str(tmp_path / "unsplit")), **load_kwargs)] == [3, 4]
    with pytest.raises(ResourceNotFoundError, match=r"no files for split 'test'.*a\.jsonl"):
        Dataset(DatasetMeta(str(tmp_path / "unsplit"), split="test"), **load_kwargs)


def test_subset_name_picks_a_sub_folder_and_ambiguity_is_refused(tmp_path, load_kwargs, write_jsonl):
    write_jsonl([{"x": "main"}], "gsm8k/main/train.jsonl")
    write_jsonl([{"x": "socratic"}], "gsm8k/socratic/train.jsonl")
    root = str(tmp_path / "gsm8k")

    assert [r["x"] for r in Dataset(DatasetMeta(root, subset_name="socratic"), **load_kwargs)] == ["socratic"]
    with pytest.raises(ConfigurationError, match=r"several sub-folders \['main', 'socratic'\].*subset_name"):
        Dataset(DatasetMeta(root), **load_kwargs)
    with pytest.raises(ResourceNotFoundError, match=r"no subset 'other'.*\['main', 'socratic'\]"):
        Dataset(DatasetMeta(root, subset_name="other"), **load_kwargs)


def test_unknown_path_and_unsupported_extension_name_the_input(tmp_path, load_kwargs):
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(ResourceNotFoundError, match="nowhere"):
        Dataset(DatasetMeta(str(missing)), **load_kwargs)
    sheet = _write(tmp_path / "rows.xlsx", "binary")
    with pytest.raises(InvalidInputError, match=r"unsupported file type '\.xlsx'.*\.jsonl"):
        Dataset(DatasetMeta(str(sheet)), **load_kwargs)
    with pytest.raises(ResourceNotFoundError, match="no data files"):
        Dataset(DatasetMeta(str(tmp_path)), **load_kwargs)  # holds only rows.xlsx


def test_malformed_jsonl_line_is_reported_with_file_and_line(tmp_path, load_kwargs):
    path = _write(tmp_path / "train.jsonl", '{"x": 1}\n{"x": 2}\n{"x": 3\n{"x": 4}\n')
    with pytest.raises(InvalidInputError, match=rf"{path}:line 3: invalid JSON"):
        Dataset(DatasetMeta(str(path)), **load_kwargs)


def test_malformed_csv_row_is_reported_with_file_and_line(tmp_path, load_kwargs):
    path = _write(tmp_path / "train.csv", "a,b\n1,2\n3,4\n5,6,7\n")
    with pytest.raises(InvalidInputError, match=rf"{path}:line 4: expected 2 fields"):
        Dataset(DatasetMeta(str(path)), **load_kwargs)


@pytest.mark.parametrize(
    "data",
    [
        [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}],
        {"a": [1, 2], "b": ["x", "y"]},
        datasets.Dataset.from_dict({"a": [1, 2], "b": ["x", "y"]}),
        datasets.DatasetDict(
            {
                "train": datasets.Dataset.from_dict({"a": [1, 2], "b": ["x", "y"]}),
                "test": datasets.Dataset.from_dict({}),
            }
        ),
        lambda: [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}],
    ],
    ids=["list", "dict", "hf", "hf-dict", "callable"],
)
def test_in_memory_data(data):
    dataset = Dataset(DatasetMeta(data=data))
    assert [dataset[0], dataset[1]] == [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    assert dataset[-1] == {"a": 2, "b": "y"}


def test_in_memory_rows_with_varying_nested_fields_are_kept():
    dataset = Dataset(DatasetMeta(data=[{"meta": {"a": 1}}, {"meta": {"b": [1, "x"]}}]))
    assert [row["meta"] for row in dataset] == [{"a": 1}, {"b": [1, "x"]}]


def test_bad_in_memory_data_is_rejected():
    with pytest.raises(InvalidInputError, match=r"rows \[1\] are not"):
        Dataset(DatasetMeta(data=[{"a": 1}, "oops"]))
    with pytest.raises(InvalidInputError, match="got int"):
        Dataset(DatasetMeta(data=42))
    with pytest.raises(ResourceNotFoundError, match="no split 'train'"):
        Dataset(DatasetMeta(data=datasets.DatasetDict({"test": datasets.Dataset.from_dict({"a": [1]})})))


def test_meta_is_validated():
    with pytest.raises(ConfigurationError, match="exactly one of dataset_id"):
        DatasetMeta()
    with pytest.raises(ConfigurationError, match="exactly one of dataset_id"):
        DatasetMeta("a.jsonl", data=[{"a": 1}])
    with pytest.raises(ConfigurationError, match="split"):
        DatasetMeta("a.jsonl", split="")
    with pytest.raises(ConfigurationError, match="data_slice"):
        DatasetMeta("a.jsonl", data_slice="0:10")


def test_data_slice_forms():
    rows = [{"i": i} for i in range(10)]

    def kept(data_slice):
        return [row["i"] for row in Dataset(DatasetMeta(data=rows, data_slice=data_slice))]

    assert kept(range(3)) == [0, 1, 2]
    assert kept(range(500)) == list(range(10))  # a range clips like list slicing
    assert kept(slice(2, 8, 3)) == [2, 5]
    assert kept([9, 0, 9]) == [9, 0, 9]
    with pytest.raises(InvalidInputError, match=r"outside \[0, 10\): \[10, -1\]"):
        kept([1, 10, -1])


def test_builtin_ids_resolve_through_the_hub(load_kwargs):
    cognition = Dataset(DatasetMeta("builtin://self-cognition", data_slice=range(500)), **load_kwargs)
    assert 50 <= len(cognition) <= 500
    assert set(cognition.column_names) == {"query", "response", "tag"}
    assert any("{{NAME}}" in row["response"] for row in cognition)

    gsm8k_test = Dataset(DatasetMeta("builtin://gsm8k-mini", split="test"), **load_kwargs)
    assert len(gsm8k_test) == 200
    assert gsm8k_test[0]["answer"].rsplit("####", 1)[1].strip().lstrip("-").isdigit()


def test_unknown_builtin_is_a_resource_error(load_kwargs):
    with pytest.raises(ResourceNotFoundError, match="builtin://no-such-data"):
        Dataset(DatasetMeta("builtin://no-such-data"), **load_kwargs)
