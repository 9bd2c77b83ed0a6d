"""``DatasetMeta``: where a dataset's rows come from, and which of them to use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twinkle.errors import ConfigurationError

DataSlice = slice | range | Sequence[int]


@dataclass
class DatasetMeta:
    """One data source: a dataset id (file, directory, ``builtin://``, ``hf://``, ``ms://``) or in-memory ``data``.

    ``data`` may be a list of row dicts, a dict of columns, a Hugging Face
    ``datasets.Dataset`` (or ``DatasetDict``, indexed by ``split``), or a
    zero-argument callable returning one of those — the callable form lets a
    remote worker build the rows itself instead of receiving them over the wire.

    ``subset_name`` picks a sub-folder of a dataset directory (a Hub "config",
    e.g. ``main`` of gsm8k) and ``split`` the files named after it
    (``train.jsonl``, ``test-00000-of-00001.parquet``, ``validation/...``).

    ``data_slice`` keeps some rows. A ``slice`` or ``range`` behaves like list
    slicing (``range(500)`` on 100 rows keeps all 100); an explicit sequence of
    indices must be in range, since a typo there would otherwise go unnoticed.
    """

    dataset_id: str = ""
    subset_name: str | None = None
    split: str = "train"
    data_slice: DataSlice | None = None
    data: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.dataset_id, str):
            raise ConfigurationError(f"DatasetMeta.dataset_id must be a string, got {type(self.dataset_id).__name__}")
        if bool(self.dataset_id) == (self.data is not None):
            raise ConfigurationError(
                "DatasetMeta needs exactly one of dataset_id (a path or hub id) and data (in-memory rows); "
                f"got dataset_id={self.dataset_id!r} and data of type {type(self.data).__name__}"
            )
        if not isinstance(self.split, str) or not self.split:
            raise ConfigurationError(f"DatasetMeta.split must be a non-empty string, got {self.split!r}")
        if self.subset_name is not None and (not isinstance(self.subset_name, str) or not self.subset_name):
            raise ConfigurationError(
                f"DatasetMeta.subset_name must be a non-empty string or None, got {self.subset_name!r}"
            )
        if self.data_slice is not None and (
            isinstance(self.data_slice, (str, bytes)) or not isinstance(self.data_slice, (slice, Sequence))
        ):
            raise ConfigurationError(
                f"DatasetMeta.data_slice must be a slice, a range or a sequence of row indices, got {self.data_slice!r}"
            )

    @property
    def name(self) -> str:
        """How logs and errors refer to this source."""
        return self.dataset_id or f"in-memory {type(self.data).__name__}"
