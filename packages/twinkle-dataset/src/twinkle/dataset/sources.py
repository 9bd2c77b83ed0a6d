"""Turn a :class:`DatasetMeta` into a Hugging Face ``datasets.Dataset``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from twinkle.dataset.local_files import load_files, split_files
from twinkle.dataset.meta import DatasetMeta, DataSlice
from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.hub import resolve_dataset
from twinkle.utils import get_logger

logger = get_logger(__name__)


def load_source(meta: DatasetMeta, load_kwargs: Mapping[str, Any]) -> datasets.Dataset:
    """Load the rows ``meta`` describes; ``load_kwargs`` go to ``datasets.load_dataset`` for files.

    Ids (local paths, ``builtin://``, ``hf://``, ``ms://``) resolve through
    :func:`twinkle.hub.resolve_dataset`, which raises
    :class:`~twinkle.errors.ResourceNotFoundError` naming an unknown id.
    """
    if meta.data is not None:
        data = _from_memory(meta.data, meta)
    else:
        path = Path(resolve_dataset(meta.dataset_id))
        data = load_files(split_files(path, meta.split, meta.subset_name, meta.name), meta.name, load_kwargs)
    return data if meta.data_slice is None else slice_rows(data, meta.data_slice, meta.name)


def slice_rows(data: datasets.Dataset, data_slice: DataSlice, name: str) -> datasets.Dataset:
    """Keep the rows of ``data_slice`` (slices and ranges clip like list slicing; explicit indices must exist)."""
    num_rows = len(data)
    if isinstance(data_slice, (slice, range)):
        indices: Sequence[int] = range(num_rows)[slice(data_slice.start, data_slice.stop, data_slice.step)]
        if isinstance(data_slice, range) and len(indices) < len(data_slice):
            logger.info(
                "%s: data_slice %s keeps %d rows; the dataset has only %d", name, data_slice, len(indices), num_rows
            )
    else:
        indices = list(data_slice)
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_rows]
        if bad:
            raise InvalidInputError(f"{name}: data_slice holds indices outside [0, {num_rows}): {bad[:10]}")
    return data.select(indices)


def _from_memory(data: Any, meta: DatasetMeta) -> datasets.Dataset:
    if callable(data):
        data = data()
    if isinstance(data, datasets.DatasetDict):
        if meta.split not in data:
            raise ResourceNotFoundError(f"{meta.name} has no split {meta.split!r}; splits: {sorted(data)}")
        return data[meta.split]
    if isinstance(data, datasets.Dataset):
        return data
    try:
        if isinstance(data, Mapping):
            return datasets.Dataset.from_dict(dict(data), on_mixed_types="use_json")
        if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
            not_rows = [i for i, row in enumerate(data) if not isinstance(row, Mapping)]
            if not_rows:
                raise InvalidInputError(f"{meta.name}: rows must be dicts; rows {not_rows[:10]} are not")
            return datasets.Dataset.from_list([dict(row) for row in data], on_mixed_types="use_json")
    except pa.ArrowException as exc:
        raise InvalidInputError(f"{meta.name}: cannot store the data as a table: {exc}") from exc
    raise InvalidInputError(
        f"DatasetMeta.data must be a list of row dicts, a dict of columns, a datasets.Dataset or a callable "
        f"returning one of those; got {type(data).__name__}"
    )
