"""Reading a raw row's columns with errors that name the processor and the column."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.errors import InvalidInputError


def text_column(row: Mapping[str, Any], column: str, processor: str, *, required: bool = True) -> str:
    """The string in ``row[column]``.

    A missing or null column is an error when ``required`` and ``''`` otherwise
    (``datasets`` stores absent optional columns as null). A required column
    must also hold some non-whitespace text.
    """
    value = row.get(column)
    if value is None:
        if not required:
            return ""
        raise InvalidInputError(f"{processor}: column {column!r} is missing or null (row columns: {sorted(row)})")
    if not isinstance(value, str):
        raise InvalidInputError(f"{processor}: column {column!r} must be a string, got {type(value).__name__}")
    if required and not value.strip():
        raise InvalidInputError(f"{processor}: column {column!r} is empty")
    return value
