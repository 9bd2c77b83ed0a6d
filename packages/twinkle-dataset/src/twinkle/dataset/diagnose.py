"""Find the first malformed row of a data file, so a load error can name the file and line.

These scans run only after ``datasets`` failed to read a file: loading stays
a single fast Arrow pass, and a broken file still gets a precise message.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def first_malformed_row(path: Path) -> str | None:
    """``'path:line N: reason'`` for the first bad row of ``path``, or ``None`` when no row is malformed."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _first_bad_json_line(path)
    if suffix == ".json":
        return _first_bad_json_document(path)
    if suffix == ".csv":
        return _first_bad_csv_row(path)
    if suffix == ".parquet":
        return _unreadable_parquet(path)
    return None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as file:
        yield from enumerate(file, start=1)


def _first_bad_json_line(path: Path) -> str | None:
    try:
        for number, line in _lines(path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"{path}:line {number}: invalid JSON ({exc.msg} at column {exc.colno})"
            if not isinstance(row, dict):
                return f"{path}:line {number}: expected a JSON object per line, got {type(row).__name__}"
    except UnicodeDecodeError as exc:
        return f"{path}: not UTF-8 text ({exc})"
    return None


def _first_bad_json_document(path: Path) -> str | None:
    """A ``.json`` file holds one array of objects, or (like ``datasets`` accepts) JSON Lines."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return f"{path}: not UTF-8 text ({exc})"
    if not text.lstrip().startswith("["):
        return _first_bad_json_line(path)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"{path}:line {exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            return f"{path}: element {index} of the top-level array is a {type(row).__name__}, expected an object"
    return None


def _first_bad_csv_row(path: Path) -> str | None:
    try:
        with path.open(encoding="utf-8", newline="") as file:
            reader = csv.reader(file)
            header = next(reader, None)
            if header is None:
                return f"{path}: empty CSV file (no header row)"
            for row in reader:
                if row and len(row) != len(header):
                    return (
                        f"{path}:line {reader.line_num}: expected {len(header)} fields (the header's), got {len(row)}"
                    )
    except (csv.Error, UnicodeDecodeError) as exc:
        return f"{path}: unreadable CSV ({exc})"
    return None


def _unreadable_parquet(path: Path) -> str | None:
    try:
        pq.ParquetFile(path).read()
    except (OSError, pa.ArrowException) as exc:
        return f"{path}: unreadable Parquet file ({exc})"
    return None
