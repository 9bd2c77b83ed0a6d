"""Input checks shared by every advantage: finite float arrays, option choices, positive numbers."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from twinkle.errors import InvalidInputError

T = TypeVar("T")


def finite_vector(values: Any, name: str) -> np.ndarray:
    """``values`` (list, numpy array or CPU tensor) as a 1-D float64 array with only finite entries."""
    if isinstance(values, (str, bytes)) or values is None:
        raise InvalidInputError(f"{name} must be a list of numbers, got {type(values).__name__}")
    try:
        array = np.asarray(values.tolist() if hasattr(values, "tolist") else values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{name} must be a list of numbers: {exc}") from exc
    if array.ndim != 1:
        raise InvalidInputError(f"{name} must be 1-D (one number per sample or token), got shape {array.shape}")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise InvalidInputError(f"{name}[{bad[0]}] is {array[bad[0]]}: every entry must be finite")
    return array


def is_scalar(value: Any) -> bool:
    """A single number (Python, numpy or a 0-d tensor), as opposed to a list of them."""
    return isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0


def finite_number(value: Any, name: str) -> float:
    """A scalar (see :func:`is_scalar`) as a finite float."""
    number = float(value)
    if not math.isfinite(number):
        raise InvalidInputError(f"{name} is {number}: it must be finite")
    return number


def positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidInputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def number_in(value: Any, name: str, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise InvalidInputError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def choice(value: T, name: str, choices: Sequence[T]) -> T:
    if value not in choices:
        raise InvalidInputError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def per_sample(values: Any, name: str) -> list[Any]:
    """A batch of per-sample entries (ragged sequences or scalars) as a list."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise InvalidInputError(f"{name} must be a list with one entry per sample, got {type(values).__name__}")
    return list(values)
