"""Turning what callers pass (scalars, lists, ragged per-sample lists, arrays, CPU tensors) into checked arrays.

Every metric input goes through here, so a NaN or a length mismatch is reported
with the argument name and index instead of silently poisoning a mean.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from twinkle.errors import InvalidInputError


def is_scalar(value: Any) -> bool:
    """A single number (Python, numpy or a 0-d tensor), as opposed to a list of them."""
    return isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0


def finite_number(value: Any, name: str) -> float:
    """A scalar (see :func:`is_scalar`) as a finite float."""
    number = float(value)
    if not np.isfinite(number):
        raise InvalidInputError(f"{name} is {number}: every value must be finite")
    return number


def finite_vector(values: Any, name: str) -> np.ndarray:
    """``values`` as a 1-D float64 array of finite numbers."""
    if isinstance(values, (str, bytes)) or values is None:
        raise InvalidInputError(f"{name} must be a list of numbers, got {type(values).__name__}")
    try:
        array = np.asarray(values.tolist() if hasattr(values, "tolist") else values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{name} must be a list of numbers: {exc}") from exc
    if array.ndim != 1:
        raise InvalidInputError(f"{name} must be a flat list of numbers, got shape {array.shape}")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise InvalidInputError(f"{name}[{bad[0]}] is {array[bad[0]]}: every value must be finite")
    return array


def rows(values: Any, name: str) -> list[np.ndarray]:
    """Per-sample rows: a list of sequences gives one row each; a flat list of numbers is a single row."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise InvalidInputError(f"{name} must be a list (one entry per sample), got {type(values).__name__}")
    entries = values.tolist() if hasattr(values, "tolist") else list(values)
    if all(is_scalar(entry) for entry in entries):
        return [finite_vector(entries, name)]
    result = []
    for index, entry in enumerate(entries):
        if entry is None:
            raise InvalidInputError(f"{name}[{index}] is None")
        result.append(finite_vector(entry, f"{name}[{index}]"))
    return result


def selected(values: Any, masks: Any, name: str) -> np.ndarray:
    """The entries of ``values`` (rows as in :func:`rows`) where ``masks`` (same shape, 0/1) is 1, flattened."""
    value_rows = rows(values, name)
    if masks is None:
        return np.concatenate(value_rows)
    mask_rows = rows(masks, "masks")
    if len(mask_rows) != len(value_rows):
        raise InvalidInputError(f"masks has {len(mask_rows)} rows but {name} has {len(value_rows)}")
    picked = []
    for index, (row, mask) in enumerate(zip(value_rows, mask_rows, strict=True)):
        if mask.size != row.size:
            raise InvalidInputError(f"masks[{index}] has {mask.size} entries but {name}[{index}] has {row.size}")
        if not np.isin(mask, (0.0, 1.0)).all():
            raise InvalidInputError(f"masks[{index}] must hold only 0 and 1")
        picked.append(row[mask.astype(bool)])
    return np.concatenate(picked)


def same_length(first: np.ndarray, second: np.ndarray, first_name: str, second_name: str) -> None:
    if first.size != second.size:
        raise InvalidInputError(f"{first_name} has {first.size} values but {second_name} has {second.size}")
