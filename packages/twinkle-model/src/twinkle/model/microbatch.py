"""Splitting one call's samples (and their per-sample loss inputs) into micro-batches."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from twinkle.errors import InvalidInputError


def is_per_sample(value: Any, batch_size: int) -> bool:
    """Loss inputs with one entry per sample (lists, arrays, tensors of length B) are split; others shared."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
        return False
    return hasattr(value, "__getitem__") and len(value) == batch_size


def check_loss_inputs(loss_inputs: Mapping[str, Any], batch_size: int) -> None:
    """Sequence-valued loss inputs must have exactly one entry per sample."""
    for name, value in loss_inputs.items():
        if isinstance(value, (list, tuple)) and len(value) != batch_size:
            raise InvalidInputError(
                f"loss input {name!r} has {len(value)} entries but the batch has {batch_size} samples"
            )


def micro_batches(
    features: Sequence[Any], loss_inputs: Mapping[str, Any], micro_batch_size: int | None
) -> Iterator[tuple[Sequence[Any], dict[str, Any]]]:
    """Yield ``(features, loss_inputs)`` slices of at most ``micro_batch_size`` samples."""
    size = len(features)
    step = size if micro_batch_size is None else micro_batch_size
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise InvalidInputError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")
    for start in range(0, size, step):
        end = start + step
        yield (
            features[start:end],
            {name: value[start:end] if is_per_sample(value, size) else value for name, value in loss_inputs.items()},
        )
