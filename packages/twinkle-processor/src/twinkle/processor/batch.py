"""Reading a collated batch: model keyword arguments, and per-token results split back per feature."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from twinkle.errors import InvalidInputError


def model_inputs(batch: Mapping[str, torch.Tensor], position_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """Keyword arguments for a transformers causal-LM forward on a collated batch.

    Always ``use_cache=False``: transformers (5.x) recognises a packed row from
    ``position_ids`` restarting at 0 only when there is neither an attention
    mask nor a KV cache, and a model whose config says ``use_cache=True``
    creates a cache even in training mode. With either, the packed sequences
    silently attend to one another. A padded batch passes its attention mask.

    A batch with images passes them (``pixel_values``, ``image_grid_thw``,
    ``mm_token_type_ids``). A padded one passes no ``position_ids``: the model
    computes its own multimodal positions (Qwen-VL's M-RoPE) from them and the
    attention mask. A packed one cannot leave that to the model (its sequences
    would be positioned as one), so the caller passes ``position_ids``: the
    model's positions per sequence, ``[4, 1, ΣT]`` for Qwen-VL (each sequence's
    own text positions, then its three M-RoPE rows), as
    ``twinkle.model`` computes them.
    """
    kwargs: dict[str, Any] = {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "use_cache": False,
    }
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    if "pixel_values" in batch:
        if "attention_mask" in batch:
            del kwargs["position_ids"]
        elif position_ids is None:
            raise InvalidInputError(
                "a padding-free batch with images needs the model's multimodal positions per sequence: pass "
                "model_inputs(batch, position_ids=...) (twinkle.model computes them), or use a padded batch"
            )
        for name in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
            kwargs[name] = batch[name]
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
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

    A packed batch has one row holding every feature, so it cannot be split by rows. The image tensors
    (``pixel_values``, ``image_grid_thw``) are per patch and per image, not per row: they are left out.
    """
    num_rows, width = batch["input_ids"].shape
    if num_rows != len(batch["seq_lens"]):
        raise InvalidInputError("select_rows needs a padded batch (one feature per row), not a packed one")
    selected = {
        name: tensor.index_select(0, rows.to(tensor.device))
        for name, tensor in batch.items()
        if name not in ("pixel_values", "image_grid_thw")
    }
    offsets = selected["seq_starts"] % width
    selected["seq_starts"] = torch.arange(len(rows), device=offsets.device) * width + offsets
    return selected
