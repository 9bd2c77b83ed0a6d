"""Local data files: choose the files of one split in a file or directory, then read them with ``datasets``.

Directories follow the Hub conventions, so a downloaded snapshot and a
hand-made folder load the same way: a file belongs to split ``S`` when its
name or one of its folders is ``S`` or starts with ``S`` and a separator
(``train.jsonl``, ``train-00000-of-00002.parquet``, ``test/part0.csv``). A
folder whose files name no split at all is one ``train`` split.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

import datasets
from datasets.exceptions import DatasetGenerationError

from twinkle.dataset.diagnose import first_malformed_row
from twinkle.errors import ConfigurationError, InvalidInputError, ResourceNotFoundError

#: File extension → ``datasets`` builder that reads it.
FILE_FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
KNOWN_SPLITS: tuple[str, ...] = ("train", "validation", "valid", "val", "dev", "test", "eval")
# JSON files that `datasets` and hub snapshots keep beside the data: metadata, not rows.
_METADATA_FILES = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})
_SPLIT_SEPARATORS = "-_."


def split_files(path: Path, split: str, subset_name: str | None, name: str) -> list[Path]:
    """The files holding ``split`` of the dataset at ``path`` (a file is its own single split)."""
    if path.is_file():
        if subset_name is not None:
            raise ConfigurationError(f"dataset {name!r} is the single file {path}; it has no subset {subset_name!r}")
        file_format(path, name)
        return [path]
    root = path / subset_name if subset_name is not None else path
    if not root.is_dir():
        subsets = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise ResourceNotFoundError(
            f"dataset {name!r} has no subset {subset_name!r} (sub-folders of {path}: {subsets})"
        )
    files = _data_files(root)
    if not files:
        raise ResourceNotFoundError(f"dataset {name!r}: no data files ({', '.join(FILE_FORMATS)}) under {root}")
    relative = [file.relative_to(root) for file in files]
    chosen = [file for file, rel in zip(files, relative, strict=True) if _in_split(rel, split)]
    if not chosen and split == "train" and not any(_in_split(rel, known) for rel in relative for known in KNOWN_SPLITS):
        chosen = files
    if not chosen:
        listing = ", ".join(str(rel) for rel in relative[:10])
        raise ResourceNotFoundError(
            f"dataset {name!r} has no files for split {split!r} under {root} (files: {listing})"
        )
    if subset_name is None:
        _check_one_subset(chosen, root, split, name)
    return chosen


def file_format(path: Path, name: str) -> str:
    """The ``datasets`` builder for ``path``, or a clear error for an unsupported extension."""
    builder = FILE_FORMATS.get(path.suffix.lower())
    if builder is None:
        raise InvalidInputError(
            f"dataset {name!r}: unsupported file type {path.suffix or '(none)'!r} of {path}; "
            f"supported: {', '.join(FILE_FORMATS)}"
        )
    return builder


def load_files(files: list[Path], name: str, load_kwargs: Mapping[str, Any]) -> datasets.Dataset:
    """Read ``files`` (one format) into one Arrow dataset, cached by ``datasets`` under its fingerprint."""
    builders = {file_format(file, name) for file in files}
    if len(builders) > 1:
        suffixes = sorted({file.suffix for file in files})
        raise InvalidInputError(
            f"dataset {name!r} mixes file formats {suffixes} in one split; keep one format per split"
        )
    try:
        return datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train", **load_kwargs)
    except DatasetGenerationError as exc:
        problem = next((found for found in map(first_malformed_row, files) if found), None)
        raise InvalidInputError(f"cannot load dataset {name!r}: {problem or exc.__cause__ or exc}") from exc


def _data_files(root: Path) -> list[Path]:
    return sorted(
        path
        for path in root.rglob("*")
        if path.is_file()
        and path.suffix.lower() in FILE_FORMATS
        and path.name not in _METADATA_FILES
        and not any(part.startswith(".") for part in path.relative_to(root).parts)
    )


def _in_split(relative: PurePath, split: str) -> bool:
    split = split.lower()
    for part in relative.parts:
        part = part.lower()
        if part == split or (part.startswith(split) and part[len(split)] in _SPLIT_SEPARATORS):
            return True
    return False


def _check_one_subset(files: list[Path], root: Path, split: str, name: str) -> None:
    """Refuse to merge files of several subsets (e.g. gsm8k's ``main`` and ``socratic``) into one split."""
    folders = {rel.parts[0] if len(rel.parts) > 1 else "." for rel in (file.relative_to(root) for file in files)}
    if len(folders) > 1:
        raise ConfigurationError(
            f"dataset {name!r}: files of split {split!r} lie in several sub-folders {sorted(folders)} of {root}; "
            "pass DatasetMeta(subset_name=...) to choose one"
        )
