"""Images at the server's edge: sent by value, within quotas, and refused for a text-only model."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from twinkle.errors import InvalidInputError, QuotaExceededError
from twinkle.hub import resolve_model
from twinkle.server.config import Quotas, ServerConfig
from twinkle.server.images import check_native_images, encoded_size
from twinkle.server.quotas import QuotaChecker
from twinkle.server.tinker.images import WireImage, expanded

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 40
URI = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def text_only_path() -> str:
    return str(resolve_model("builtin://qwen3-tiny"))


def quotas(**limits: int) -> QuotaChecker:
    return QuotaChecker(ServerConfig(quotas=Quotas(**limits)))


def one_image(image: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": "<image>what?"}], "images": [image]}


def test_encoded_size_is_the_payload_and_paths_or_urls_are_refused():
    assert encoded_size(URI, "x") == len(PNG)
    with pytest.raises(InvalidInputError, match=r"images\[0\] is a path \('/etc/passwd'\); images are sent by value"):
        encoded_size("/etc/passwd", "images[0]")
    with pytest.raises(InvalidInputError, match="is a remote URL"):
        encoded_size("https://example.com/cat.png", "images[0]")


def test_quotas_count_and_size_images_before_anything_else(text_only_path):
    with pytest.raises(QuotaExceededError, match="has 2 images; the quota max_images_per_request") as many:
        check_native_images(quotas(max_images_per_request=1), "u", text_only_path, "m", [one_image(URI)] * 2)
    assert many.value.limit == "max_images_per_request"
    with pytest.raises(QuotaExceededError, match=f"image 0 is {len(PNG)} bytes; the quota max_image_bytes") as big:
        check_native_images(quotas(max_image_bytes=10), "u", text_only_path, "m", one_image(URI))
    assert big.value.limit == "max_image_bytes"


def test_a_text_only_model_refuses_images_on_both_apis(text_only_path):
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.images holds 1 image\(s\) but .* is a text-only model"):
        check_native_images(quotas(), "u", text_only_path, "builtin://qwen3-tiny", [one_image(URI)])
    feature = {"input_ids": [1, 2], "pixel_values": [[0.0]], "image_grid_thw": [[1, 1, 1]], "mm_token_type_ids": [0, 1]}
    with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.pixel_values holds 1 image\(s\)"):
        check_native_images(quotas(), "u", text_only_path, "builtin://qwen3-tiny", [feature])
    image = WireImage(1, PNG, "png", 4, "data[0].model_input[1]")
    with pytest.raises(InvalidInputError, match=r"data\[0\]\.model_input holds 1 image\(s\) but .* text-only"):
        expanded(np.array([5, 6]), [image], text_only_path, "builtin://qwen3-tiny", "data[0].model_input")
    check_native_images(quotas(), "u", text_only_path, "m", [{"messages": [{"role": "user", "content": "hi"}]}])
