"""Images tenants send to the native API: by value, within their quotas, readable, and for a model that sees.

A trajectory's ``images`` reach the server as ``data:`` URIs (``twinkle_client`` turns paths, bytes and PIL
images into them before sending): a path or ``file://`` URL would name a file on the *server*, so it is
refused, as are remote URLs. Every image is checked here, at the edge, before the request is queued: how
many there are (``max_images_per_request``) and how large each is (``max_image_bytes``), that the served
model takes images, that the placeholders match them (the template's own check), and that each decodes.
So one tenant's bad image is a 4xx for that request alone and never fails a pass shared with others.
Features that already hold ``pixel_values`` (encoded by a template) count as images too.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.server.quotas import QuotaChecker
from twinkle.template import ImageEncoder, checked_trajectory_images, load_image

DATA_URI = "data:"


@lru_cache(maxsize=4)
def vision_encoder(model_path: str) -> ImageEncoder | None:
    """The image processor and image token of the model at ``model_path``; None for a text-only model."""
    return ImageEncoder.from_model_dir(Path(model_path))


def text_only_error(where: str, count: int, model_id: str) -> InvalidInputError:
    return InvalidInputError(
        f"{where} holds {count} image(s) but the server's model {model_id!r} is a text-only model "
        "(it has no image processor); serve a vision-language model, e.g. builtin://qwen3-vl-tiny"
    )


def encoded_size(image: Any, where: str) -> int:
    """The bytes of an image sent as a base64 ``data:`` URI; anything else is refused, naming what it is."""
    if not isinstance(image, str):
        raise InvalidInputError(
            f"{where} is {type(image).__name__}; images reach the server as data: URIs (twinkle_client sends "
            "paths, bytes and PIL images that way)"
        )
    if not image.startswith(DATA_URI):
        kind = "a remote URL" if image.startswith(("http://", "https://")) else "a path"
        raise InvalidInputError(
            f"{where} is {kind} ({image[:60]!r}); images are sent by value, as data:image/...;base64 URIs "
            "(twinkle_client reads a local file and sends its bytes)"
        )
    header, _, payload = image.partition(",")
    if not header.endswith(";base64"):
        raise InvalidInputError(f"{where} is a data URI that is not base64-encoded ({header[:40]!r})")
    payload = payload.strip()
    if len(payload) % 4:
        raise InvalidInputError(f"{where} is a data URI whose base64 payload has a length that is not a multiple of 4")
    return len(payload) // 4 * 3 - payload[-2:].count("=")


def check_native_images(
    quotas: QuotaChecker, user: str, model_path: str, model_id: str, inputs: Any, where: str = "inputs"
) -> None:
    """Refuse (4xx) any bad image in a native request's ``inputs`` (features, trajectories or lists of them)."""
    items = [inputs] if isinstance(inputs, Mapping) else inputs if isinstance(inputs, list) else []
    encoder = vision_encoder(model_path)
    sizes: list[int] = []
    trajectories: list[tuple[str, Mapping[str, Any], list[Any]]] = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        at = f"{where}[{index}]"
        if "input_ids" in item:  # a feature: its pixel values are bounded by its tokens
            if item.get("pixel_values") is not None:
                count = len(item.get("image_grid_thw") or [])
                if encoder is None:
                    raise text_only_error(f"{at}.pixel_values", count, model_id)
                sizes += [0] * count
            continue
        images = item.get("images") or []
        if not isinstance(images, list):
            raise InvalidInputError(f"{at}.images must be a list of images, got {type(images).__name__}")
        sizes += [encoded_size(image, f"{at}.images[{number}]") for number, image in enumerate(images)]
        if images:
            trajectories.append((at, item, images))
    quotas.check_images(user, sizes, where)
    for at, item, images in trajectories:
        if encoder is None:
            raise text_only_error(f"{at}.images", len(images), model_id)
        try:
            checked_trajectory_images(item, encoder, model_id)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{at}: {exc}") from exc
        for number, image in enumerate(images):
            load_image(image, f"{at}.images[{number}]")  # a corrupt or truncated image fails here
