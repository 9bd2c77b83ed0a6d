"""Tinker image chunks: the encoded images a ``ModelInput`` carries, and the vision tokens they become.

In Tinker the client tokenizes text itself and sends each image as its encoded bytes (PNG or JPEG) in an
image chunk between text chunks. For Qwen-VL the text before it ends with ``<|vision_start|>`` and the text
after it starts with ``<|vision_end|>``, as the chat template renders an image (tinker-cookbook's renderers
do this). The chunk stands for as many positions as the image has vision tokens: ``expected_tokens``, which
the SDK needs for ``ModelInput.length`` and which the loss inputs' lengths include. Here each image goes
through the served model's image processor (:class:`twinkle.template.ImageEncoder`, the one the Template
uses), its chunk becomes that many image tokens, and the datum gets ``pixel_values``, ``image_grid_thw`` and
``mm_token_type_ids``: the feature the Template makes of the same conversation. Uploaded images
(``image_asset_pointer`` chunks) are refused: this server has no uploads.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from twinkle.errors import InvalidInputError
from twinkle.server.images import text_only_error, vision_encoder
from twinkle.template import load_image

if TYPE_CHECKING:
    from twinkle.server.tinker.codec import Datum

FORMATS = ("png", "jpeg")


@dataclass
class WireImage:
    """One image chunk as sent: its encoded bytes, and where its vision tokens go."""

    offset: int  # the text tokens before it in its ModelInput
    data: bytes
    format: str
    expected_tokens: int | None
    where: str  # the chunk, for error messages (``data[0].model_input[1]``)


def image_from_proto(msg: pb.ImageChunk, offset: int, where: str) -> WireImage:
    if msg.HasField("override_dimensions"):
        raise InvalidInputError(f"{where}.override_dimensions is not supported: resize the image before sending it")
    expected = msg.expected_tokens if msg.HasField("expected_tokens") else None
    return _checked(WireImage(offset, bytes(msg.data), msg.format, expected, where))


def image_from_json(chunk: Mapping[str, Any], offset: int, where: str) -> WireImage:
    data, expected = chunk.get("data"), chunk.get("expected_tokens")
    if not isinstance(data, str):
        raise InvalidInputError(f"{where}.data: must be the image's bytes, base64-encoded")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidInputError(f"{where}.data: is not valid base64: {exc}") from exc
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, int)):
        raise InvalidInputError(f"{where}.expected_tokens: must be an integer, got {expected!r:.40}")
    if chunk.get("override_dimensions") is not None:
        raise InvalidInputError(f"{where}.override_dimensions is not supported: resize the image before sending it")
    return _checked(WireImage(offset, raw, str(chunk.get("format")), expected, where))


def _checked(image: WireImage) -> WireImage:
    if image.format not in FORMATS:
        raise InvalidInputError(f"{image.where}.format: must be one of {FORMATS}, got {image.format!r}")
    if not image.data:
        raise InvalidInputError(f"{image.where}.data: is empty")
    if image.expected_tokens is not None and image.expected_tokens < 1:
        raise InvalidInputError(f"{image.where}.expected_tokens: must be at least 1, got {image.expected_tokens}")
    return image


def image_sizes(images: Sequence[WireImage]) -> list[int]:
    """Each image's encoded bytes, for the ``max_images_per_request`` / ``max_image_bytes`` quotas."""
    return [len(image.data) for image in images]


def expand_images(datum: Datum, model_path: str, model_id: str, where: str) -> None:
    """Put each image's vision tokens into ``datum.tokens`` at its offset and its pixel values into
    ``datum.features``; refuses, naming the chunk, a text-only model, an unreadable image, a wrong
    ``expected_tokens``, and image tokens sent as text (an image token with no image)."""
    datum.tokens, datum.features = expanded(datum.tokens, datum.images, model_path, model_id, where)


def expanded(
    tokens: np.ndarray, images: Sequence[WireImage], model_path: str, model_id: str, where: str
) -> tuple[np.ndarray, dict[str, Any]]:
    """``tokens`` (int64, text only) with the images' vision tokens, and the images' model inputs."""
    encoder = vision_encoder(model_path)
    if encoder is not None and np.any(tokens == encoder.image_token_id):
        raise InvalidInputError(
            f"{where}: an encoded_text chunk holds the image token id {encoder.image_token_id}, which stands for an "
            "image's vision tokens: send each image as an image chunk and the server puts its tokens there"
        )
    if not images:
        return tokens, {}
    if encoder is None:
        raise text_only_error(where, len(images), model_id)
    decoded = [load_image(image.data, image.where) for image in images]
    pixel_values, grid_thw = encoder.process(decoded, f"{where} images")
    counts = encoder.token_counts(grid_thw)
    pieces: list[np.ndarray] = []
    types: list[int] = []
    start = 0
    for image, count, grid in zip(images, counts, grid_thw, strict=True):
        if image.expected_tokens is not None and image.expected_tokens != count:
            raise InvalidInputError(
                f"{image.where}: expected_tokens is {image.expected_tokens} but this image takes {count} vision "
                f"tokens in {model_id!r} (a {'x'.join(str(int(n)) for n in grid)} patch grid, merged "
                f"{encoder.merge_size}x{encoder.merge_size})"
            )
        text = tokens[start : image.offset]
        pieces += [text, np.full(count, encoder.image_token_id, dtype=np.int64)]
        types += [0] * len(text) + [1] * count
        start = image.offset
    pieces.append(tokens[start:])
    types += [0] * (len(tokens) - start)
    features = {"pixel_values": pixel_values, "image_grid_thw": grid_thw, "mm_token_type_ids": types}
    return np.concatenate(pieces), features
