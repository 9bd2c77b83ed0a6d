"""Apply a row function to a ``datasets.Dataset``, reporting rows it rejects instead of losing them.

Two ``Dataset.map`` passes, so both run under ``num_proc`` and are cached by fingerprint:

1. *stage*: call the function on every row and store, under a fixed schema, its
   output as one JSON value, or why it rejected the row (it raised
   :class:`~twinkle.errors.InvalidInputError`), or nothing (it returned ``None``
   to drop the row). A fixed schema means batches can never disagree, and the
   rejections survive worker processes and the cache.
2. *unstage*: once rejected rows are raised or dropped, spread the outputs into
   columns. Columns are ``datasets.Json`` — an exact round trip of any value
   (messages with optional fields, ``user_data`` whose keys vary by row) —
   except ``native_features`` such as token ids, stored as ``int32`` lists.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import datasets
import pyarrow.compute as pc
from datasets import Features, Json, List, Value

from twinkle.dataset.errors import MAX_REPORTED_ROWS, DataProcessingError, format_bad_rows
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.utils import get_logger

logger = get_logger(__name__)

RowFunction = Callable[[dict[str, Any]], Mapping[str, Any] | None]

#: ``Dataset.map`` options a caller may pass through.
HF_MAP_OPTIONS = frozenset(
    {"batch_size", "num_proc", "load_from_cache_file", "keep_in_memory", "writer_batch_size", "desc"}
)

_ROW, _ERROR, _INDEX, _KEYS = "__twinkle_row__", "__twinkle_error__", "__twinkle_index__", "__twinkle_keys__"
_STAGED_FEATURES = Features(
    {_ROW: Json(), _ERROR: Value("string"), _INDEX: Value("int64"), _KEYS: List(Value("string"))}
)


@dataclass(frozen=True)
class MapResult:
    """The mapped rows and what happened to the others."""

    data: datasets.Dataset
    num_input: int
    num_dropped: int  # the function returned None
    num_bad: int  # the function rejected them (so strict=False dropped them)


def hf_map_options(options: Mapping[str, Any], batched: bool = True) -> dict[str, Any]:
    """Validate pass-through ``Dataset.map`` options; ``batched=False`` means one row per batch."""
    unknown = sorted(set(options) - HF_MAP_OPTIONS)
    if unknown:
        raise ConfigurationError(f"unknown map option(s) {unknown}; supported: {sorted(HF_MAP_OPTIONS)} and batched")
    return {**options, "batch_size": 1} if not batched else dict(options)


def map_rows(
    data: datasets.Dataset,
    row_fn: RowFunction,
    step: str,
    *,
    strict: bool = True,
    native_features: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
) -> MapResult:
    """Apply ``row_fn`` to every row of ``data``; ``step`` names it in errors and logs.

    With ``strict`` a :class:`DataProcessingError` lists the rejected rows after
    the pass; otherwise they are dropped with a warning that counts them.
    """
    if len(data) == 0:  # `datasets` skips functions on empty tables, so there is nothing to stage
        return MapResult(data, 0, 0, 0)
    options = {"desc": step, **(options or {})}
    staged = data.map(
        _stage_batch,
        batched=True,
        with_indices=True,
        remove_columns=data.column_names,
        features=_STAGED_FEATURES,
        fn_kwargs={"row_fn": row_fn},
        **options,
    )
    table = staged.with_format("arrow")  # bookkeeping columns are read without decoding any row
    num_bad = _report_rejections(table, step, strict, len(data))
    kept = pc.indices_nonzero(pc.is_valid(table[_KEYS]))
    columns = pc.unique(pc.list_flatten(table[_KEYS])).to_pylist()  # in first-seen order
    if len(kept) < len(staged):
        staged = staged.select(kept.to_numpy())
    result = _unstage(staged, columns, native_features or {}, {**options, "desc": f"{options['desc']} (columns)"})
    return MapResult(result, len(data), len(data) - num_bad - len(kept), num_bad)


def _report_rejections(table: datasets.Dataset, step: str, strict: bool, num_rows: int) -> int:
    """Raise (``strict``) or log the rows the function rejected; return how many there were."""
    errors = table[_ERROR]
    bad_positions = pc.indices_nonzero(pc.is_valid(errors))
    num_bad = len(bad_positions)
    if num_bad:
        first = bad_positions[:MAX_REPORTED_ROWS]
        bad_rows = list(zip(table[_INDEX].take(first).to_pylist(), errors.take(first).to_pylist(), strict=True))
        if strict:
            raise DataProcessingError.from_rows(step, bad_rows, num_bad, num_rows)
        logger.warning(
            "%s: dropped %d of %d invalid rows (strict=False):\n%s", step, num_bad, num_rows, format_bad_rows(bad_rows)
        )
    return num_bad


def _unstage(
    staged: datasets.Dataset, columns: list[str], native_features: Mapping[str, Any], options: Mapping[str, Any]
) -> datasets.Dataset:
    """Spread the staged outputs into ``columns``: ``native_features`` as given, every other one as Json."""
    return staged.map(
        _unstage_batch,
        batched=True,
        input_columns=[_ROW],
        remove_columns=staged.column_names,
        features=Features({column: native_features.get(column, Json()) for column in columns}),
        fn_kwargs={
            "json_columns": [column for column in columns if column not in native_features],
            "native_columns": [column for column in columns if column in native_features],
        },
        **options,
    )


def batch_rows(batch: Mapping[str, list[Any]], num_rows: int) -> Iterator[dict[str, Any]]:
    """The rows of a column-major batch (``num_rows`` is explicit: a batch may have no columns)."""
    names = list(batch)
    for position in range(num_rows):
        yield {name: batch[name][position] for name in names}


def _stage_batch(batch: dict[str, list[Any]], indices: list[int], row_fn: RowFunction) -> dict[str, list[Any]]:
    outputs: dict[str, list[Any]] = {_ROW: [], _ERROR: [], _INDEX: list(indices), _KEYS: []}
    for row in batch_rows(batch, len(indices)):
        error: str | None = None
        try:
            output = _checked(row_fn(row))
        except InvalidInputError as exc:
            output, error = None, str(exc)
        outputs[_ROW].append(None if output is None else output[0])
        outputs[_KEYS].append(None if output is None else output[1])
        outputs[_ERROR].append(error)
    return outputs


def _checked(output: Any) -> tuple[str, list[str]] | None:
    """A row function's output as (JSON text, its keys), or None for a row dropped on purpose."""
    if output is None:
        return None
    if not isinstance(output, Mapping):
        raise InvalidInputError(f"the row function returned {type(output).__name__}; it must return a dict or None")
    try:
        text = json.dumps(output, ensure_ascii=False, default=_plain)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"the row function's output is not JSON-serialisable: {exc}") from exc
    return text, [str(key) for key in output]


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (and tensors) as Python values, the only non-JSON values accepted."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _unstage_batch(
    rows: list[dict[str, Any]], json_columns: list[str], native_columns: list[str]
) -> dict[str, list[Any]]:
    # Json columns get encoded text: a plain string value would otherwise be parsed if it looks like JSON ("42").
    outputs = {
        column: [json.dumps(row[column], ensure_ascii=False) if column in row else None for row in rows]
        for column in json_columns
    }
    outputs.update({column: [row.get(column) for row in rows] for column in native_columns})
    return outputs
