"""CLEVR-style rows (``{image, question, answer}``, e.g. ``builtin://clevr-mini``) to image questions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, Trajectory
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.preprocessor.columns import text_column
from twinkle.registry import register

CLEVR_INSTRUCTION = "Answer with one word or number."


@register("preprocessor")
class CLEVRProcessor(Preprocessor):
    """One user turn holding the image (an ``<image>`` placeholder) and the question; the answer for SFT.

    ``images`` gets the row's ``image`` as stored (a path, a data URI, or a ``{"bytes", "path"}`` dict as
    ``datasets`` stores images); the template decodes it. ``user_data`` carries the reference ``answer``
    (and the question ``type`` when the row has one) for accuracy rewards. ``include_answer=False`` gives
    prompts only, for sampling (RL); ``instruction`` is appended to the question (``None``: nothing).
    """

    def __init__(self, include_answer: bool = False, instruction: str | None = CLEVR_INSTRUCTION) -> None:
        self.include_answer = include_answer
        self.instruction = instruction

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        name = type(self).__name__
        question = text_column(row, "question", name)
        answer = text_column(row, "answer", name).strip()
        image = row.get("image")
        if not image:
            raise InvalidInputError(f"{name}: column 'image' is missing or empty (row columns: {sorted(row)})")
        prompt = f"<image>{question}" + (f"\n{self.instruction}" if self.instruction else "")
        messages: list[Message] = [{"role": "user", "content": prompt}]
        if self.include_answer:
            messages.append({"role": "assistant", "content": answer})
        user_data: dict[str, Any] = {"answer": answer}
        if isinstance(row.get("type"), str):
            user_data["type"] = row["type"]
        return {"messages": messages, "images": [image], "user_data": user_data}
