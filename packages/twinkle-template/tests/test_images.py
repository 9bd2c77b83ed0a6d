"""Images in trajectories, checked against transformers' own Qwen3-VL processor on builtin://qwen3-vl-tiny."""

from __future__ import annotations

import base64
import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

from twinkle.errors import InvalidInputError
from twinkle.hub import resolve_model
from twinkle.template import SequenceTooLongError, Template

IMAGE_TOKEN = 151655


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
    """transformers' Qwen3-VL processor without its video processor, which needs torchvision (not installed)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module")
def vl_dir() -> str:
    return resolve_model("builtin://qwen3-vl-tiny")


@pytest.fixture(scope="module")
def vl_template(vl_dir: str) -> Template:
    return Template(vl_dir, max_length=None)


@pytest.fixture(scope="module")
def reference(vl_dir: str) -> Qwen3VLProcessor:
    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    return ImageOnlyQwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(vl_dir), tokenizer=tokenizer)


def scene(size: tuple[int, int], color: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", size, (128, 128, 128))
    image.paste(color, (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    return image


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def as_parts(content: str) -> Any:
    if "<image>" not in content:
        return content
    pieces = content.split("<image>")
    parts: list[dict[str, str]] = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
    return parts


def test_features_equal_the_transformers_processor(vl_template, reference, tmp_path: Path) -> None:
    red, wide, tall = scene((64, 64), (220, 40, 40)), scene((96, 64), (40, 80, 220)), scene((40, 120), (40, 180, 60))
    (tmp_path / "wide.png").write_bytes(png(wide))
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "<image>What color is the square?"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "And here: <image> and <image>?"},
        {"role": "assistant", "content": "blue and green"},
    ]
    data_uri = "data:image/png;base64," + base64.b64encode(png(tall)).decode()
    images = [red, str(tmp_path / "wide.png"), data_uri]  # a PIL image, a path and a data URI
    feature = vl_template.encode({"messages": messages, "images": images})

    chat = [{**message, "content": as_parts(message["content"])} for message in messages]
    text = reference.tokenizer.apply_chat_template(chat, tokenize=False)
    expected = reference(text=[text], images=[red, wide, tall], return_tensors="np")
    assert feature["input_ids"] == expected["input_ids"][0].tolist()
    assert feature["mm_token_type_ids"] == expected["mm_token_type_ids"][0].tolist()
    assert np.array_equal(np.asarray(feature["image_grid_thw"]), expected["image_grid_thw"])
    assert np.array_equal(np.asarray(feature["pixel_values"], dtype=np.float32), expected["pixel_values"])
    assert feature["image_grid_thw"] == [[1, 4, 4], [1, 4, 6], [1, 8, 2]]
    assert sum(feature["mm_token_type_ids"]) == 4 + 6 + 4


def test_only_assistant_tokens_are_trained(vl_template, trained) -> None:
    messages = [
        {"role": "user", "content": "<image>How many objects are there?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "<image>What color is the circle?"},
        {"role": "assistant", "content": "red"},
    ]
    images = [png(scene((64, 64), (220, 40, 40))), {"bytes": png(scene((64, 64), (40, 80, 220)))}]
    feature = vl_template.encode({"messages": messages, "images": images})
    assert trained(vl_template, feature) == ["2<|im_end|>", "<think>\n\n</think>\n\nred<|im_end|>"]
    image_positions = [i for i, token in enumerate(feature["input_ids"]) if token == IMAGE_TOKEN]
    assert len(image_positions) == 8 and all(feature["labels"][i] == -100 for i in image_positions)
    assert [feature["mm_token_type_ids"][i] for i in image_positions] == [1] * 8
    assert sum(feature["mm_token_type_ids"]) == 8


def test_generation_prompt_carries_the_images(vl_template, reference) -> None:
    image = scene((64, 64), (230, 210, 40))
    messages = [{"role": "user", "content": "<image>Color?"}, {"role": "assistant", "content": "yellow"}]
    feature = vl_template.encode({"messages": messages, "images": [image]}, add_generation_prompt=True)
    chat = [{"role": "user", "content": as_parts("<image>Color?")}]
    text = reference.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    expected = reference(text=[text], images=[image], return_tensors="np")
    assert feature["input_ids"] == expected["input_ids"][0].tolist() and set(feature["labels"]) == {-100}
    assert np.array_equal(np.asarray(feature["pixel_values"], dtype=np.float32), expected["pixel_values"])


@pytest.mark.parametrize(
    ("images", "content", "message"),
    [
        ([b"not an image"], "<image>Hi", "trajectory.images[0] is not a readable image"),
        (["truncated"], "<image>Hi", "trajectory.images[0] is not a readable image"),
        (["/no/such/file.png"], "<image>Hi", "trajectory.images[0]: no image file at '/no/such/file.png'"),
        (["https://example.com/a.png"], "<image>Hi", "is a remote URL"),
        (["red", "red"], "<image>Hi", "holds 1 <image> placeholder(s) but trajectory.images holds 2 image(s)"),
        (["red"], "<image><image>Hi", "holds 2 <image> placeholder(s) but trajectory.images holds 1 image(s)"),
        (["red"], "Hi", "holds 0 <image> placeholder(s)"),
        ([42], "<image>Hi", "trajectory.images[0] must be a path, a data URI, bytes"),
    ],
)
def test_bad_images_are_refused_by_name(vl_template, images, content, message) -> None:
    good = png(scene((64, 64), (220, 40, 40)))
    resolved = [
        good if image == "red" else good[: len(good) // 2] if image == "truncated" else image for image in images
    ]
    trajectory = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        vl_template.encode({**trajectory, "images": resolved})


def test_images_for_a_text_only_model_or_an_assistant_turn_are_refused(vl_template, template) -> None:
    image = png(scene((64, 64), (220, 40, 40)))
    trajectory = {"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(InvalidInputError, match=r"holds 1 image\(s\) but .* is a text-only model"):
        template.encode({**trajectory, "images": [image]})
    in_answer = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<image>"}]}
    with pytest.raises(InvalidInputError, match=r"messages\[1\] is a assistant message with an <image>"):
        vl_template.encode({**in_answer, "images": [image]})


def test_truncation_never_cuts_an_image(vl_template) -> None:
    trajectory = {
        "messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "a b c d e f"}],
        "images": [png(scene((64, 64), (220, 40, 40)))],
    }
    full = vl_template.encode(trajectory)
    assert full is not None

    @contextlib.contextmanager
    def truncating(max_length: int, strategy: str) -> Iterator[Template]:
        # The module's template with another length policy (a copy would reload its tokenizer: slow).
        saved = vl_template.max_length, vl_template.truncation_strategy
        vl_template.max_length, vl_template.truncation_strategy = max_length, strategy
        try:
            yield vl_template
        finally:
            vl_template.max_length, vl_template.truncation_strategy = saved

    with truncating(len(full["input_ids"]) - 2, "right") as template:
        kept = template.encode(trajectory)
    assert kept is not None and kept["mm_token_type_ids"] == full["mm_token_type_ids"][:-2]
    with (
        truncating(len(full["input_ids"]) - 8, "left") as template,
        pytest.raises(SequenceTooLongError, match="would cut image tokens"),
    ):
        template.encode(trajectory)
