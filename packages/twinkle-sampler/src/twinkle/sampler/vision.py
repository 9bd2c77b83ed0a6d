"""Image prompts for :class:`twinkle.sampler.TorchSampler`: the prefill's image inputs and multimodal positions.

A vision-language prompt (an ``InputFeature`` the template encoded with images) carries ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids``. Its prefill runs the model's multimodal base (vision tower,
projector, language model) on the left-padded prompts with the positions the model itself assigns
(Qwen-VL's M-RoPE: an image's tokens are positioned by their patch grid). Every later token is positioned
one after the previous, shifted by its prompt's *rope delta* (how far the multimodal positions ran ahead of
or behind the token count), exactly as transformers' own generation does; text-only prompts have delta 0.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from twinkle.data_format import InputFeature
from twinkle.errors import InvalidInputError

__all__ = ["image_digest", "image_prefill_inputs", "multimodal_base"]


def multimodal_base(model: Any) -> Any | None:
    """The base of a vision-language model (it takes ``pixel_values``); None for a text-only model."""
    base = getattr(model, "model", None)
    forward = getattr(base, "forward", None)
    if forward is None or "pixel_values" not in inspect.signature(forward).parameters:
        return None
    return base if hasattr(base, "get_rope_index") else None


def image_digest(feature: InputFeature) -> str | None:
    """A digest of a prompt's images (None without any): prompts with equal tokens but other images differ."""
    pixel_values = feature.get("pixel_values")
    if pixel_values is None:
        return None
    digest = hashlib.sha256(np.asarray(pixel_values, dtype=np.float32).tobytes())
    digest.update(np.asarray(feature.get("image_grid_thw"), dtype=np.int64).tobytes())
    return digest.hexdigest()


def image_prefill_inputs(
    features: Sequence[InputFeature], mask_UL: torch.Tensor, base: Any | None, dtype: torch.dtype
) -> dict[str, torch.Tensor] | None:
    """``pixel_values``, ``image_grid_thw`` and left-padded ``mm_token_type_ids`` of the prompts (None: no image)."""
    with_images = [i for i, feature in enumerate(features) if feature.get("pixel_values") is not None]
    if not with_images:
        return None
    if base is None:
        raise InvalidInputError(f"inputs{with_images[:5]} carry images but the sampler's model takes no images")
    device, length = mask_UL.device, mask_UL.shape[1]
    types_UL = torch.zeros_like(mask_UL)
    for row, feature in enumerate(features):
        types = feature.get("mm_token_type_ids")
        if types:
            types_UL[row, length - len(types) :] = torch.tensor(types, device=device)
    pixels = [torch.as_tensor(np.asarray(features[i]["pixel_values"], dtype=np.float32)) for i in with_images]
    grids = [torch.as_tensor(np.asarray(features[i]["image_grid_thw"], dtype=np.int64)) for i in with_images]
    return {
        "pixel_values": torch.cat(pixels).to(device=device, dtype=dtype),
        "image_grid_thw": torch.cat(grids).to(device),
        "mm_token_type_ids": types_UL,
    }
