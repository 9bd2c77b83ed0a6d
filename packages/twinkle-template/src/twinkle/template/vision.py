"""Images in trajectories: decoding them, the model's image processor, and its vision tokens.

A trajectory marks where each image goes with an ``<image>`` placeholder in a message's content and lists
the images in ``images``, in order. The template turns such content into the parts chat templates of
vision-language models take (``{"type": "image"}``, ``{"type": "text", ...}``), so the model's own chat
template renders the image's marker (Qwen-VL: ``<|vision_start|><|image_pad|><|vision_end|>``). After
tokenizing, :meth:`ImageEncoder.expand` repeats each image token once per vision token of its image (the
image processor's patch grid divided by the merge size squared), as the model's transformers processor
does, and marks those positions in ``mm_token_type_ids``; they are never trained.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import InvalidInputError
from twinkle.template.errors import SequenceTooLongError, TemplateError

if TYPE_CHECKING:
    import numpy as np
    from PIL.Image import Image

__all__ = [
    "IMAGE_PLACEHOLDER",
    "ImageEncoder",
    "ImageInputs",
    "checked_trajectory_images",
    "image_parts",
    "load_image",
    "trajectory_images",
]

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class ImageInputs:
    """A trajectory's images as the model takes them: every patch, and each image's patch grid."""

    pixel_values: np.ndarray  # [patches, patch_dim] float32
    grid_thw: np.ndarray  # [images, 3] int64


def load_image(image: Any, where: str) -> Image:
    """Decode one trajectory image (path, ``file://`` URL, data URI, bytes, ``{"bytes", "path"}``, PIL) to RGB."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if isinstance(image, PILImage.Image):
        return image.convert("RGB")
    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
    source: Any
    if isinstance(image, bytes):
        source = io.BytesIO(image)
    elif isinstance(image, str) and image.startswith("data:"):
        header, _, payload = image.partition(",")
        if not header.endswith(";base64"):
            raise InvalidInputError(f"{where} is a data URI that is not base64-encoded ({header[:40]!r})")
        try:
            source = io.BytesIO(base64.b64decode(payload, validate=True))
        except ValueError as exc:
            raise InvalidInputError(f"{where} is a data URI whose base64 payload is invalid: {exc}") from exc
    elif isinstance(image, str):
        if image.startswith(("http://", "https://")):
            raise InvalidInputError(f"{where} is a remote URL ({image[:60]!r}); images are read from local files")
        path = Path(image.removeprefix("file://")).expanduser()
        if not path.is_file():
            raise InvalidInputError(f"{where}: no image file at {str(path)!r}")
        source = path
    else:
        raise InvalidInputError(f"{where} is not an image (path, data URI, bytes or PIL image): {type(image).__name__}")
    try:
        with PILImage.open(source) as opened:
            rgb: Image = opened.convert("RGB")  # decodes the whole file: truncated data fails here, not later
            return rgb
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise InvalidInputError(f"{where} is not a readable image: {exc}") from exc


def image_parts(content: str) -> list[dict[str, str]]:
    """``content`` with each ``<image>`` placeholder as an image part between text parts."""
    parts: list[dict[str, str]] = []
    for index, text in enumerate(content.split(IMAGE_PLACEHOLDER)):
        if index:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def count_placeholders(messages: Sequence[Mapping[str, Any]], where: str) -> int:
    """How many ``<image>`` placeholders the messages hold; only user and system turns may hold one."""
    total = 0
    for index, message in enumerate(messages):
        found = (message.get("content") or "").count(IMAGE_PLACEHOLDER)
        if found and message["role"] not in ("user", "system"):
            raise InvalidInputError(
                f"{where}[{index}] is a {message['role']} message with an {IMAGE_PLACEHOLDER} placeholder; "
                "images may only be given in user or system messages"
            )
        total += found
    return total


class ImageEncoder:
    """A vision-language model's image processor and image token, loaded from its model directory."""

    def __init__(self, model_dir: Path, image_token_id: int) -> None:
        from transformers import AutoImageProcessor

        self.model_dir = model_dir
        self.image_token_id = image_token_id
        self._processor: Any = AutoImageProcessor.from_pretrained(str(model_dir))
        self.merge_size = int(getattr(self._processor, "merge_size", 1))

    @classmethod
    def from_model_dir(cls, model_dir: Path | None) -> ImageEncoder | None:
        """The encoder of a model whose directory has an image processor and an ``image_token_id``; else None."""
        if model_dir is None or not (model_dir / "preprocessor_config.json").is_file():
            return None
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        image_token_id = config.get("image_token_id", config.get("image_token_index"))
        return None if image_token_id is None else cls(model_dir, int(image_token_id))

    def __getstate__(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "image_token_id": self.image_token_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model_dir"], state["image_token_id"])  # type: ignore[misc]

    def process(self, images: Sequence[Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        """``pixel_values`` ``[patches, patch_dim]`` (float32) and ``image_grid_thw`` ``[images, 3]`` of ``images``."""
        import numpy as np

        decoded = [load_image(image, f"{where}[{index}]") for index, image in enumerate(images)]
        try:
            out = self._processor(images=decoded, return_tensors="np")
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses
            raise InvalidInputError(f"{where}: the image processor refused an image: {exc}") from exc
        return np.asarray(out["pixel_values"], dtype=np.float32), np.asarray(out["image_grid_thw"], dtype=np.int64)

    def token_counts(self, grid_thw: np.ndarray) -> list[int]:
        """How many vision tokens (image tokens in ``input_ids``) each image of ``image_grid_thw`` takes."""
        return [int(grid.prod()) // self.merge_size**2 for grid in grid_thw]

    def expand(
        self, input_ids: list[int], labels: list[int], grid_thw: np.ndarray, where: str
    ) -> tuple[list[int], list[int], list[int]]:
        """Repeat each image token once per vision token of its image; also return ``mm_token_type_ids``."""
        counts = [int(grid.prod()) // self.merge_size**2 for grid in grid_thw]
        positions = [index for index, token in enumerate(input_ids) if token == self.image_token_id]
        if len(positions) != len(counts):
            raise TemplateError(
                f"{where}: the chat template rendered {len(positions)} image tokens for {len(counts)} images; "
                "it must render one per image part"
            )
        ids: list[int] = []
        new_labels: list[int] = []
        types: list[int] = []
        start = 0
        for position, count in zip(positions, counts, strict=True):
            ids += input_ids[start:position] + [self.image_token_id] * count
            new_labels += labels[start:position] + [IGNORE_INDEX] * count
            types += [0] * (position - start) + [1] * count
            start = position + 1
        ids += input_ids[start:]
        new_labels += labels[start:]
        types += [0] * (len(input_ids) - start)
        return ids, new_labels, types


def checked_trajectory_images(trajectory: Mapping[str, Any], encoder: ImageEncoder | None, model_id: str) -> list[Any]:
    """The trajectory's images (not decoded), once checked against its ``<image>`` placeholders and the model."""
    images = list(trajectory.get("images") or [])
    if not images:
        return images
    if encoder is None:
        raise InvalidInputError(
            f"trajectory.images holds {len(images)} image(s) but {model_id!r} is a text-only model (its directory "
            "has no image processor, preprocessor_config.json, and its config no image_token_id)"
        )
    for key in ("messages", "rejected_messages"):
        messages = trajectory.get(key)
        placeholders = 0 if messages is None else count_placeholders(messages, f"trajectory.{key}")
        if messages is not None and placeholders != len(images):
            raise InvalidInputError(
                f"trajectory.{key} holds {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) but trajectory.images "
                f"holds {len(images)} image(s); put one {IMAGE_PLACEHOLDER} in a user message where each image goes"
            )
    return images


def trajectory_images(trajectory: Mapping[str, Any], encoder: ImageEncoder | None, model_id: str) -> ImageInputs | None:
    """The trajectory's processed images (None without any), checked against its ``<image>`` placeholders."""
    images = checked_trajectory_images(trajectory, encoder, model_id)
    if not images:
        return None
    assert encoder is not None  # checked_trajectory_images refuses images for a text-only model
    return ImageInputs(*encoder.process(images, "trajectory.images"))


def with_images(
    encoder: ImageEncoder | None,
    input_ids: list[int],
    labels: list[int],
    images: ImageInputs | None,
    extra: dict[str, Any],
    where: str,
) -> tuple[list[int], list[int], dict[str, Any]]:
    """Each image token repeated per vision token, and the pixel features added to ``extra``."""
    if images is None or encoder is None:
        return input_ids, labels, extra
    input_ids, labels, types = encoder.expand(input_ids, labels, images.grid_thw, where)
    pixels = {"pixel_values": images.pixel_values.tolist(), "image_grid_thw": images.grid_thw.tolist()}
    return input_ids, labels, {**extra, **pixels, "mm_token_type_ids": types}


def truncate_image_types(extra: dict[str, Any], length: int, kept: int, strategy: str, where: str) -> dict[str, Any]:
    """``extra`` with ``mm_token_type_ids`` cut as the tokens were; refuses a cut through an image's tokens."""
    types = extra.get("mm_token_type_ids")
    if types is None or kept == length:
        return extra
    cut = types[length - kept :] if strategy == "left" else types[:kept]
    if sum(cut) != sum(types):
        raise SequenceTooLongError(
            f"{where} encodes to {length} tokens, more than max_length={kept}, and truncating it ({strategy!r}) "
            "would cut image tokens; raise max_length or use truncation_strategy='delete'"
        )
    return {**extra, "mm_token_type_ids": cut}
