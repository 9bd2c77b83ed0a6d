"""Collating the image features of vision-language rows: pixel patches, patch grids, image-token types.

Every row's ``pixel_values`` are concatenated in batch order (``[Σpatches, patch_dim]`` float32) with their
``image_grid_thw`` (``[images, 3]``), as transformers' processors batch them; ``mm_token_type_ids`` is laid
out like ``input_ids`` (0 on padding; concatenated in a padding-free batch). Rows without images add nothing,
so a batch may mix text-only and image rows. A padded batch lets the model compute its multimodal positions
(Qwen-VL's M-RoPE) from each row and its attention mask; a padding-free one needs them per sequence from the
model (see :func:`twinkle.processor.model_inputs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from twinkle.data_format import InputFeature
from twinkle.errors import InvalidInputError


def vision_tensors(
    features: Sequence[InputFeature], batch: Mapping[str, torch.Tensor], padding_side: Literal["right", "left"] | None
) -> dict[str, torch.Tensor]:
    """The batch's image tensors (none when no row has images); ``padding_side`` None means padding-free."""
    rows = [i for i, feature in enumerate(features) if feature.get("pixel_values") is not None]
    if not rows:
        return {}
    pixels, grids = [], []
    for i in rows:
        pixel_values = torch.as_tensor(features[i]["pixel_values"], dtype=torch.float32)  # lists or arrays
        grid_thw = torch.as_tensor(features[i]["image_grid_thw"], dtype=torch.long).reshape(-1, 3)
        if pixel_values.ndim != 2 or pixel_values.shape[0] != int(grid_thw.prod(-1).sum()):
            raise InvalidInputError(
                f"features[{i}].pixel_values has shape {tuple(pixel_values.shape)} but its image_grid_thw "
                f"{grid_thw.tolist()} needs {int(grid_thw.prod(-1).sum())} patch rows"
            )
        if not features[i].get("mm_token_type_ids"):
            raise InvalidInputError(f"features[{i}] has pixel_values but no mm_token_type_ids")
        pixels.append(pixel_values)
        grids.append(grid_thw)
    rows_types = [torch.as_tensor(feature.get("mm_token_type_ids") or [], dtype=torch.long) for feature in features]
    rows_types = [
        types if len(types) else torch.zeros(len(feature["input_ids"]), dtype=torch.long)
        for types, feature in zip(rows_types, features, strict=True)
    ]
    if padding_side is None:  # padding-free: one row, every feature after the other
        types = torch.cat(rows_types).unsqueeze(0)
    else:
        width = batch["input_ids"].shape[1]
        types = torch.zeros((len(features), width), dtype=torch.long)
        for i, row in enumerate(rows_types):
            if padding_side == "right":
                types[i, : len(row)] = row
            else:
                types[i, width - len(row) :] = row
    return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids), "mm_token_type_ids": types}
