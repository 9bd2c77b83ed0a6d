"""``builtin://clevr-mini``: CLEVR-style image questions with short answers that a reward can verify.

Each row is one 64x64 scene drawn with Pillow: one to four flat shapes (``square``, ``circle``,
``triangle``) in four colours (``red``, ``green``, ``blue``, ``yellow``) on a grey background, each in its
own cell of a 3x3 grid so that none overlap. A question is asked about the scene, and the answer is
computed from the scene, so it is right by construction:

- ``count``: "How many objects are there?" (``1``-``4``);
- ``count_color``: "How many red objects are there?" (``0``-``4``);
- ``color``: "What color is the circle?" when exactly one object has that shape (a colour name);
- ``shape``: "What shape is the blue object?" when exactly one object has that colour (a shape name).

Rows are ``{"image", "question", "answer", "type", "objects"}``: ``image`` is the PNG as a
``data:image/png;base64,...`` URI (so a row is self-contained wherever the file is copied), ``objects``
the scene (``color``, ``shape``, ``x``, ``y`` of each centre in pixels). Scenes come from a seeded
``random.Random``; every build writes the same bytes with the same Pillow. Train and test scenes differ.
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path
from typing import Any

from twinkle.hub.data.jsonl import write_jsonl

__all__ = ["COLORS", "IMAGE_SIZE", "SHAPES", "build", "draw_scene", "make_row"]

TRAIN_SIZE = 1000
TEST_SIZE = 200
SEED = 17
IMAGE_SIZE = 64
BACKGROUND = (128, 128, 128)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
SHAPES = ("square", "circle", "triangle")
_CELL = IMAGE_SIZE // 3  # 21 px cells; shapes are at most 16 px across, so neighbours never touch
_HALF_SIZE = (6, 8)  # half the width of a shape, drawn per object


def draw_scene(objects: list[dict[str, Any]]) -> bytes:
    """PNG bytes of the scene: each object's shape, filled in its colour, centred at ``(x, y)``."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        x, y, half, fill = obj["x"], obj["y"], obj["half"], COLORS[obj["color"]]
        if obj["shape"] == "square":
            draw.rectangle((x - half, y - half, x + half, y + half), fill=fill)
        elif obj["shape"] == "circle":
            draw.ellipse((x - half, y - half, x + half, y + half), fill=fill)
        else:
            draw.polygon(((x, y - half), (x - half, y + half), (x + half, y + half)), fill=fill)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def _scene(rng: random.Random) -> list[dict[str, Any]]:
    cells = rng.sample(range(9), rng.randint(1, 4))
    objects = []
    for cell in cells:
        half = rng.randint(*_HALF_SIZE)
        jitter = _CELL // 2 - half  # keeps the shape inside its cell
        x = (cell % 3) * _CELL + _CELL // 2 + rng.randint(-jitter, jitter)
        y = (cell // 3) * _CELL + _CELL // 2 + rng.randint(-jitter, jitter)
        objects.append({"color": rng.choice(list(COLORS)), "shape": rng.choice(SHAPES), "x": x, "y": y, "half": half})
    return objects


def _question(rng: random.Random, objects: list[dict[str, Any]]) -> tuple[str, str, str]:
    """A question about ``objects``, its answer and its type; types the scene cannot answer are skipped."""
    colors = [obj["color"] for obj in objects]
    shapes = [obj["shape"] for obj in objects]
    unique_shapes = [shape for shape in SHAPES if shapes.count(shape) == 1]
    unique_colors = [color for color in COLORS if colors.count(color) == 1]
    kinds = ["count", "count_color"] + ["color"] * bool(unique_shapes) + ["shape"] * bool(unique_colors)
    kind = rng.choice(kinds)
    if kind == "count":
        return "How many objects are there?", str(len(objects)), kind
    if kind == "count_color":
        color = rng.choice(list(COLORS))
        return f"How many {color} objects are there?", str(colors.count(color)), kind
    if kind == "color":
        shape = rng.choice(unique_shapes)
        return f"What color is the {shape}?", colors[shapes.index(shape)], kind
    color = rng.choice(unique_colors)
    return f"What shape is the {color} object?", shapes[colors.index(color)], kind


def make_row(rng: random.Random) -> dict[str, Any]:
    """One scene, drawn, with one question about it."""
    objects = _scene(rng)
    question, answer, kind = _question(rng, objects)
    image = "data:image/png;base64," + base64.b64encode(draw_scene(objects)).decode("ascii")
    scene = [{key: obj[key] for key in ("color", "shape", "x", "y")} for obj in objects]
    return {"image": image, "question": question, "answer": answer, "type": kind, "objects": scene}


def build(target: Path) -> None:
    """Write ``train.jsonl`` and ``test.jsonl``; a test row never repeats a train row's scene and question."""
    rng = random.Random(SEED)
    seen: set[str] = set()
    for split, size in (("train", TRAIN_SIZE), ("test", TEST_SIZE)):
        rows: list[dict[str, Any]] = []
        while len(rows) < size:
            row = make_row(rng)
            key = row["image"] + row["question"]
            if key not in seen:
                seen.add(key)
                rows.append(row)
        write_jsonl(target / f"{split}.jsonl", rows)
