"""Vision-language batches: the model part that takes images, and a packed batch's multimodal positions.

A padded batch with images goes to the model's multimodal base (vision tower, merger, language model), which
positions every row itself (Qwen-VL's M-RoPE) from the image grids and the attention mask. A padding-free
batch holds every sequence in one row with no mask, so its positions are computed here, sequence by sequence,
with the model's own ``get_rope_index``: ``[4, 1, ΣT]``, each sequence's text positions (0..n-1, from which
attention sees where sequences start) and then its three M-RoPE rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from twinkle.errors import InvalidInputError
from twinkle.module import images_per_row

__all__ = ["multimodal_base", "packed_multimodal_positions"]


def multimodal_base(inner: Any) -> Any:
    """A vision-language model's base (vision tower, projector and language model), which takes images."""
    base = getattr(inner, "model", None)
    if base is None or "pixel_values" not in inspect.signature(base.forward).parameters:
        raise InvalidInputError(f"the batch has images but {type(inner).__name__} takes no images")
    return base


def packed_multimodal_positions(inner: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """``[4, 1, ΣT]`` positions of a padding-free batch with images; None for any other batch."""
    if "pixel_values" not in batch or "attention_mask" in batch:
        return None
    base = multimodal_base(inner)
    if not hasattr(base, "get_rope_index"):
        raise InvalidInputError(f"{type(inner).__name__} has no get_rope_index to position a padding-free batch")
    ids_1T, types_1T, grids = batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"]
    pieces, used = [], 0
    for start, length in zip(batch["seq_starts"].tolist(), batch["seq_lens"].tolist(), strict=True):
        types = types_1T[:, start : start + length]
        images = int(images_per_row(types)[0])
        positions_31N, _ = base.get_rope_index(
            ids_1T[:, start : start + length],
            mm_token_type_ids=types,
            image_grid_thw=grids[used : used + images] if images else None,
        )
        pieces.append(positions_31N)
        used += images
    if used != grids.shape[0]:
        raise InvalidInputError(f"the batch's image tokens make {used} images but image_grid_thw has {grids.shape[0]}")
    return torch.cat([batch["position_ids"].unsqueeze(0), torch.cat(pieces, dim=2)], dim=0)
