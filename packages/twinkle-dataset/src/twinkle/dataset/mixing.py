"""Combine several datasets into one: back to back (``concat``) or sampled in turns (``interleave``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import datasets

from twinkle.errors import ConfigurationError, InvalidInputError

MixStrategy = Literal["concat", "interleave"]


def mix_datasets(
    parts: Sequence[datasets.Dataset],
    names: Sequence[str],
    strategy: MixStrategy = "concat",
    probabilities: Sequence[float] | None = None,
    seed: int = 42,
    stopping_strategy: str = "first_exhausted",
) -> datasets.Dataset:
    """One dataset from ``parts`` (named ``names`` in errors), which must share their columns.

    ``interleave`` alternates between parts, or draws the next part at random
    with ``probabilities`` (reproducible through ``seed``); it stops when the
    first part runs out unless ``stopping_strategy='all_exhausted'``.
    """
    if strategy not in ("concat", "interleave"):
        raise ConfigurationError(f"unknown mix strategy {strategy!r}; use 'concat' or 'interleave'")
    _check_same_columns(parts, names)
    if strategy == "concat":
        if probabilities is not None:
            raise ConfigurationError("probabilities apply only to strategy='interleave'")
        return datasets.concatenate_datasets(list(parts))
    if probabilities is not None:
        _check_probabilities(probabilities, len(parts))
        probabilities = list(probabilities)
    return datasets.interleave_datasets(
        list(parts), probabilities=probabilities, seed=seed, stopping_strategy=stopping_strategy
    )


def _check_same_columns(parts: Sequence[datasets.Dataset], names: Sequence[str]) -> None:
    if all(part.features == parts[0].features for part in parts[1:]):
        return
    described = "; ".join(f"{name!r}: {dict(part.features)}" for name, part in zip(names, parts, strict=True))
    raise InvalidInputError(
        f"cannot mix datasets whose columns differ ({described}). "
        "Map each one to the same format first, e.g. map(preprocessor, source=...) before mix()"
    )


def _check_probabilities(probabilities: Sequence[float], num_parts: int) -> None:
    if len(probabilities) != num_parts:
        raise ConfigurationError(f"got {len(probabilities)} probabilities for {num_parts} datasets")
    if any(p < 0 for p in probabilities) or not math.isclose(sum(probabilities), 1.0, abs_tol=1e-6):
        raise ConfigurationError(f"probabilities must be non-negative and sum to 1, got {list(probabilities)}")
