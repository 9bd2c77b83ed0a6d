"""Reading a collated batch: model keyword arguments, and per-token results split back per feature."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.errors import InvalidInputError


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Keyword arguments for a transformers causal-LM forward on a collated batch.

    Always ``use_cache=False``: transformers (5.x) recognises a packed row from
    ``position_ids`` restarting at 0 only when there is neither an attention
    mask nor a KV cache, and a model whose config says ``use_cache=True``
    creates a cache even in training mode. With either, the packed sequences
    silently attend to one another. A padded batch passes its attention mask.

    A batch with images passes them (``pixel_values``, ``image_grid_thw``,
    ``mm_token_type_ids``) and no ``position_ids``: the model computes its own
    multimodal positions (Qwen-VL's M-RoPE) from them and the attention mask.
    """
    kwargs: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "use_cache": False,
    }
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    if "pixel_values" in batch:
        del kwargs["position_ids"]
        for name in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
            kwargs[name] = batch[name]
    return kwargs


def unpack(tensor: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Split a per-token tensor of ``batch`` into one ``[n_i, ...]`` tensor per feature, padding dropped.

    ``tensor`` has the batch's token layout in its first two dims: ``[B, T, ...]``
    for a padded batch, ``[1, ΣT, ...]`` for a packed one (logits, per-token
    log-probs aligned with ``labels``, ...). Works for both layouts through
    ``seq_starts``/``seq_lens``, so callers need not know which one was used.
    """
    layout = tuple(batch["input_ids"].shape)
    if tuple(tensor.shape[:2]) != layout:
        raise InvalidInputError(
            f"cannot unpack a tensor of shape {tuple(tensor.shape)}: its first two dims must match "
            f"the batch's input_ids {layout}"
        )
    tokens = tensor.flatten(0, 1)
    return [
        tokens[start : start + length]
        for start, length in zip(batch["seq_starts"].tolist(), batch["seq_lens"].tolist(), strict=True)
    ]


def select_rows(batch: Mapping[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The padded batch made of rows ``rows`` of ``batch`` (same width), ``seq_starts`` renumbered.

    A packed batch has one row holding every feature, so it cannot be split by rows.
    """
    num_rows, width = batch["input_ids"].shape
    if num_rows != len(batch["seq_lens"]):
        raise InvalidInputError("select_rows needs a padded batch (one feature per row), not a packed one")
    selected = {name: tensor.index_select(0, rows.to(tensor.device)) for name, tensor in batch.items()}
    offsets = selected["seq_starts"] % width
    selected["seq_starts"] = torch.arange(len(rows), device=offsets.device) * width + offsets
    return selected
