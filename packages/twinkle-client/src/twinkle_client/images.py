"""Trajectory images sent by value: every image a request carries becomes a ``data:`` URI here.

In-process, a trajectory's ``images`` may be local paths, ``file://`` URLs, encoded bytes, ``{"bytes",
"path"}`` dicts or PIL images. A server cannot read this machine's files (and would refuse a path, which
would name one of *its* files), and the wire codec carries no bytes or PIL objects, so before a request
leaves, each image is read and sent as ``data:image/<type>;base64,...``: the form the server's template
decodes. Images that already are data URIs pass unchanged; remote ``http(s)`` URLs are refused here. The
server checks the images against its quotas (``max_images_per_request``, ``max_image_bytes``). No PIL,
torch or numpy is needed here: a PIL image is saved through its own ``save`` method.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twinkle.errors import InvalidInputError

# Leading bytes of the formats an image processor reads, for the data URI's media type.
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
    (b"GIF8", "gif"),
    (b"BM", "bmp"),
)


def images_by_value(inputs: Any) -> Any:
    """``inputs`` (a feature, a trajectory, or a list of them) with every trajectory image as a data URI.

    Only trajectories with ``images`` are copied; everything else is returned as it is.
    """
    if isinstance(inputs, Mapping):
        return _trajectory(inputs, "inputs")
    if isinstance(inputs, list):
        return [
            _trajectory(item, f"inputs[{i}]") if isinstance(item, Mapping) else item for i, item in enumerate(inputs)
        ]
    return inputs


def data_uri(image: Any, where: str = "image") -> str:
    """One image (path, ``file://`` URL, data URI, bytes, ``{"bytes", "path"}`` dict or PIL image) as a data URI."""
    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str):
        if image.startswith("data:"):
            return image
        if image.startswith(("http://", "https://")):
            raise InvalidInputError(f"{where} is a remote URL ({image[:60]!r}); download it and pass its bytes")
        path = Path(image.removeprefix("file://")).expanduser()
        if not path.is_file():
            raise InvalidInputError(f"{where}: no image file at {str(path)!r}")
        data = path.read_bytes()
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif callable(getattr(image, "save", None)) and hasattr(image, "size"):  # a PIL image
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    else:
        raise InvalidInputError(
            f"{where} is not an image (path, data URI, bytes, {{'bytes', 'path'}} dict or PIL image): "
            f"{type(image).__name__}"
        )
    if not data:
        raise InvalidInputError(f"{where} is empty")
    kind = next((name for signature, name in _SIGNATURES if data.startswith(signature)), None)
    if kind is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind = "webp"
    return f"data:image/{kind or 'unknown'};base64,{base64.b64encode(data).decode('ascii')}"


def _trajectory(item: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    images = item.get("images")
    if "input_ids" in item or not isinstance(images, list) or not images:
        return item
    return {**item, "images": [data_uri(image, f"{where}.images[{i}]") for i, image in enumerate(images)]}
