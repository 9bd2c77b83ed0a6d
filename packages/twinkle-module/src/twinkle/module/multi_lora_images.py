"""Per-row adapters on a vision tower: each image's patches take the adapter of the batch row it belongs to.

A vision-language batch hands its vision tower every image's patches flattened into one ``[ΣP, D]`` input,
images in batch order (row by row, then image by image within a row), each image a contiguous block of
``t·h·w`` patches (its ``image_grid_thw``). The tower's blocks run on patches; its mergers run on groups of
``spatial_merge_size²`` consecutive patches (one language-model token each). :class:`ImageRows` maps both
back to batch rows, so :func:`~twinkle.module.adapter_rows` can route a tower's :class:`MultiLoraLinear`
layers as it routes the language model's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from twinkle.errors import InvalidInputError
from twinkle.module.multi_lora import RowRouting

__all__ = ["ImageRows", "images_per_row"]

IMAGE_TOKEN = 1  # mm_token_type_ids: 0 text, 1 image, 2 video


def images_per_row(mm_token_type_ids_BT: torch.Tensor) -> torch.Tensor:
    """``[B]`` images in each row: the runs of image tokens (an image's tokens are contiguous)."""
    image_BT = mm_token_type_ids_BT == IMAGE_TOKEN
    starts_BT = image_BT.clone()
    starts_BT[:, 1:] &= ~image_BT[:, :-1]
    return starts_BT.sum(dim=1)


@dataclass(frozen=True)
class ImageRows:
    """A batch's images seen from its vision tower: the batch row of every patch."""

    tower: nn.Module
    patch_rows_P: torch.Tensor
    merge_unit: int  # consecutive patches merged into one token

    @classmethod
    def of_batch(
        cls, tower: nn.Module, mm_token_type_ids_BT: torch.Tensor, image_grid_thw_I3: torch.Tensor
    ) -> ImageRows:
        """The images of a batch whose rows' image tokens are marked in ``mm_token_type_ids_BT``."""
        merge_size = getattr(tower, "spatial_merge_size", None)
        if not isinstance(merge_size, int):
            raise InvalidInputError(f"{type(tower).__name__} has no spatial_merge_size: not a Qwen-VL vision tower")
        counts_B = images_per_row(mm_token_type_ids_BT)
        if int(counts_B.sum()) != image_grid_thw_I3.shape[0]:
            raise InvalidInputError(
                f"the batch's image tokens make {int(counts_B.sum())} images but image_grid_thw has "
                f"{image_grid_thw_I3.shape[0]}"
            )
        device = next(tower.parameters()).device  # where the tower's routing is used
        image_rows_I = torch.arange(counts_B.numel(), device=device).repeat_interleave(counts_B.to(device))
        patch_rows_P = image_rows_I.repeat_interleave(image_grid_thw_I3.prod(dim=-1).to(device))
        return cls(tower, patch_rows_P, merge_size * merge_size)

    def routing(self, rows: RowRouting) -> RowRouting:
        """The tower's routing: by patch, and (for the mergers) by merged token."""
        merged = rows.for_tokens(self.patch_rows_P[:: self.merge_unit])
        return replace(rows.for_tokens(self.patch_rows_P), alternates=(merged,))
