"""Values between the wire and the in-process API: tensors out as numpy arrays, results as plain dicts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from twinkle.data_format import Serializable


def to_wire(value: Any) -> Any:
    """A result ready for the codec: tensors become numpy arrays (bfloat16/half as float32), dataclasses dicts."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.is_floating_point() and tensor.dtype not in (torch.float32, torch.float64):
            tensor = tensor.float()
        return tensor.numpy()
    if isinstance(value, Serializable):
        return {name: to_wire(field) for name, field in vars(value).items()}
    if isinstance(value, Mapping):
        return {key: to_wire(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def from_wire(value: Any) -> Any:
    """Request values as the in-process API takes them: numpy arrays stay arrays, except in features.

    Token ids and labels inside features must be plain lists (the feature
    validators check Python ints), so 1-d integer arrays become lists.
    """
    if isinstance(value, Mapping):
        return {key: _plain_ids(item) if key in _ID_FIELDS else from_wire(item) for key, item in value.items()}
    if isinstance(value, list):
        if _SCALARS.issuperset(map(type, value)):  # a number list: nothing inside to convert (C-speed check)
            return value
        return [from_wire(item) for item in value]
    return value


_SCALARS = frozenset({int, float, bool, str, type(None)})


_ID_FIELDS = frozenset({"input_ids", "labels", "loss_mask", "position_ids", "attention_mask"})


def _plain_ids(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value
