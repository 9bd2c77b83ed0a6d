"""Splitting one call's samples (and their per-sample loss inputs) into micro-batches, and calling the loss."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Loss


def entry_count(value: Any) -> int | None:
    """The length of a sequence-valued loss input (list, tuple, array, tensor); ``None`` for scalars and mappings.

    A 0-d array or tensor is a scalar: ``len()`` of one raises ``TypeError``.
    """
    if isinstance(value, (str, bytes, Mapping)) or getattr(value, "ndim", None) == 0 or not hasattr(value, "__len__"):
        return None
    return len(value)


def is_per_sample(value: Any, batch_size: int) -> bool:
    """Loss inputs with one entry per sample (lists, arrays, tensors of length B) are split; others shared."""
    return hasattr(value, "__getitem__") and entry_count(value) == batch_size


def check_loss_inputs(loss_inputs: Mapping[str, Any], batch_size: int) -> None:
    """Sequence-valued loss inputs must have exactly one entry per sample.

    Arrays and tensors included: one of the wrong length would be shared by every micro-batch, and
    silently line up with each of them when its length happens to equal the micro-batch size.
    """
    for name, value in loss_inputs.items():
        count = entry_count(value)
        if count is not None and count != batch_size:
            raise InvalidInputError(f"loss input {name!r} has {count} entries but the batch has {batch_size} samples")


def check_micro_batch_size(micro_batch_size: int | None) -> None:
    if micro_batch_size is not None and (
        isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1
    ):
        raise InvalidInputError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}")


def check_pairs_stay_whole(loss: Loss | None, batch_size: int, micro_batch_size: int | None) -> None:
    """A ``pairwise`` loss's call is never cut into micro-batches: their contiguous slices would separate pairs."""
    if getattr(loss, "pairwise", False) and micro_batch_size is not None and micro_batch_size < batch_size:
        raise InvalidInputError(
            f"{type(loss).__name__} pairs sequence i with sequence i + N of its 2N, which micro-batches of "
            f"{micro_batch_size} would separate; call forward_backward with micro_batch_size=None (accumulate "
            "gradients over several calls for large batches)"
        )


def micro_batches(
    features: Sequence[Any], loss_inputs: Mapping[str, Any], micro_batch_size: int | None
) -> Iterator[tuple[Sequence[Any], dict[str, Any]]]:
    """Yield ``(features, loss_inputs)`` slices of at most ``micro_batch_size`` samples."""
    size = len(features)
    check_micro_batch_size(micro_batch_size)
    step = size if micro_batch_size is None else micro_batch_size
    for start in range(0, size, step):
        yield features[start : start + step], slice_loss_inputs(loss_inputs, size, start, start + step)


def slice_loss_inputs(loss_inputs: Mapping[str, Any], batch_size: int, start: int, end: int) -> dict[str, Any]:
    """Samples ``start:end`` of the per-sample loss inputs; shared ones (scalars, configs) as they are."""
    return {
        name: value[start:end] if is_per_sample(value, batch_size) else value for name, value in loss_inputs.items()
    }


def checked_loss(
    loss_fn: Loss,
    batch: Mapping[str, torch.Tensor],
    output: ModelOutput,
    normalizer: float | None,
    loss_inputs: Mapping[str, Any],
    weight: float | None = None,
) -> LossOutput:
    """``loss_fn`` on one (micro-)batch: a finite scalar, scaled by ``weight`` when there is no normaliser."""
    kwargs = dict(loss_inputs) if normalizer is None else {**loss_inputs, "normalizer": normalizer}
    loss_output = loss_fn(batch, output, **kwargs)
    name = type(loss_fn).__name__
    if not torch.is_tensor(loss_output.loss) or loss_output.loss.dim() != 0:
        raise InvalidInputError(f"loss {name} must return a scalar tensor")
    if not torch.isfinite(loss_output.loss):
        raise InvalidInputError(f"loss {name} is not finite ({float(loss_output.loss.detach())})")
    if weight is not None:
        loss_output.loss = loss_output.loss * weight
    return loss_output
