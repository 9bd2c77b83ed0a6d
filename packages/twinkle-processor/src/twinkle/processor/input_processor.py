"""``InputProcessor``: the collator between encoded features and a model forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from twinkle.data_format import InputFeature
from twinkle.errors import ConfigurationError
from twinkle.infra import DeviceMesh
from twinkle.processor.features import complete_features
from twinkle.processor.packing import pack_rows
from twinkle.processor.padding import pad_rows
from twinkle.processor.routing import routing_tensor
from twinkle.processor.vision import vision_tensors
from twinkle.registry import register


@register("processor")
class InputProcessor:
    """Collate :class:`~twinkle.data_format.InputFeature` dicts into model tensors.

    Padded (default) — every tensor ``[B, T]``, ``T`` the longest feature:
    ``input_ids`` (``pad_token_id`` on ``padding_side``), ``attention_mask``,
    ``position_ids``, ``labels`` (``-100`` on padding), ``loss_mask`` (float,
    0 on padding).

    Padding-free — every feature concatenated into one ``[1, ΣT]`` row with
    ``position_ids`` restarting at 0 per feature, no ``attention_mask``, plus
    ``cu_seq_lens`` (int32 ``[N + 1]``). Nothing is spent on padding; forward it
    with :func:`twinkle.processor.model_inputs`, which says what transformers needs.

    Both layouts add ``seq_lens`` ``[N]`` and ``seq_starts`` ``[N]`` so that
    :func:`twinkle.processor.unpack` can split per-token results back per feature,
    and, when features recorded their MoE routing, ``routed_experts``
    ``[B, T, layers, top_k]`` (-1 where nothing was recorded). Rows with images
    (vision-language models; padded layout only) add ``pixel_values``,
    ``image_grid_thw`` and ``mm_token_type_ids`` (see :mod:`twinkle.processor.vision`).
    Labels stay unshifted, and each feature's first label is ignored: the loss
    shift makes it untrainable anyway, and it keeps a packed row (or left
    padding) from training one sequence's last token to predict the next one's first.

    ``pad_token_id`` defaults to 0 and is a settable attribute: the model sets it
    to its tokenizer's pad id when the processor is attached. Padded positions are
    masked out, so any embeddable id gives the same results.
    """

    def __init__(
        self,
        padding_side: Literal["right", "left"] = "right",
        padding_free: bool = False,
        pad_token_id: int = 0,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        """``device`` defaults to the current device of ``device_mesh.device_type``; with neither, tensors stay on CPU.

        ``max_length`` rejects longer features instead of truncating them: cutting
        a sequence silently changes what is trained, so the template (which knows
        the truncation policy) is where that belongs.
        """
        if padding_side not in ("right", "left"):
            raise ConfigurationError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ConfigurationError(f"max_length must be a positive int or None, got {max_length!r}")
        if device_mesh is not None and device_mesh.size("cp") > 1:
            raise ConfigurationError(
                "InputProcessor does not split sequences for context parallelism "
                f"(device_mesh cp={device_mesh.size('cp')})"
            )
        self.padding_side = padding_side
        self.padding_free = padding_free
        self.pad_token_id = pad_token_id  # validated by the property setter
        self.max_length = max_length
        if device is None and device_mesh is not None:
            device = device_mesh.device_type
        self.device = torch.device(device) if device is not None else None

    @property
    def pad_token_id(self) -> int:
        """The id written into padded ``input_ids`` positions (the model sets its tokenizer's)."""
        return self._pad_token_id

    @pad_token_id.setter
    def pad_token_id(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(f"pad_token_id must be a non-negative int, got {value!r}")
        self._pad_token_id = value

    def __call__(self, features: Sequence[InputFeature]) -> dict[str, torch.Tensor]:
        """Collate ``features`` (see the class docstring for the layout); non-token fields are not collated."""
        rows = complete_features(features, self.max_length)
        batch = pack_rows(rows) if self.padding_free else pad_rows(rows, self.pad_token_id, self.padding_side)
        batch["loss_mask"] = batch["loss_mask"].float()
        batch.update(vision_tensors(features, batch, None if self.padding_free else self.padding_side))
        routed_BTLK = routing_tensor(features, batch)
        if routed_BTLK is not None:
            batch["routed_experts"] = routed_BTLK
        if self.device is not None:
            batch = {name: tensor.to(self.device) for name, tensor in batch.items()}
        return batch

    def __repr__(self) -> str:
        layout = "padding_free" if self.padding_free else f"padding_side={self.padding_side!r}"
        return f"InputProcessor({layout}, pad_token_id={self.pad_token_id}, max_length={self.max_length})"
