"""Preference rows (``{prompt, chosen, rejected}``) to a chosen conversation and its rejected alternative."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, Trajectory
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.preprocessor.columns import text_column
from twinkle.preprocessor.llm.messages import normalize_messages, prepend_system
from twinkle.registry import register


@register("preprocessor")
class DPOProcessor(Preprocessor):
    """Builds ``{'messages': prompt + chosen, 'rejected_messages': prompt + rejected}``.

    ``prompt`` is a string (one user turn) or a list of messages. ``chosen`` and
    ``rejected`` are each a string (one assistant answer), a list of messages
    continuing the prompt (starting with an assistant turn), or a whole
    conversation (starting with a system or user turn; ``prompt`` may then be
    absent, as in HH-RLHF). Both sides must end with an assistant turn and differ.
    """

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        prompt = self._prompt(row)
        chosen = self._side(row, "chosen", prompt)
        rejected = self._side(row, "rejected", prompt)
        if chosen == rejected:
            raise InvalidInputError(
                f"{type(self).__name__}: columns 'chosen' and 'rejected' give the same conversation; "
                "a preference pair needs two different answers"
            )
        return {"messages": chosen, "rejected_messages": rejected}

    def _prompt(self, row: Mapping[str, Any]) -> list[Message] | None:
        value = row.get("prompt")
        if value is None:
            return None
        if isinstance(value, str):
            return [{"role": "user", "content": text_column(row, "prompt", type(self).__name__)}]
        return normalize_messages(value, "prompt", type(self).__name__)

    def _side(self, row: Mapping[str, Any], column: str, prompt: list[Message] | None) -> list[Message]:
        name = type(self).__name__
        value = row.get(column)
        if isinstance(value, str):
            messages: list[Message] = [{"role": "assistant", "content": text_column(row, column, name)}]
        else:
            messages = normalize_messages(value, column, name)
        if messages[0]["role"] == "assistant":
            if prompt is None:
                raise InvalidInputError(
                    f"{name}: column 'prompt' is missing or null but column {column!r} holds only the answer "
                    f"(row columns: {sorted(row)})"
                )
            messages = [*prompt, *messages]
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
            raise InvalidInputError(f"{name}: column {column!r} must end with a non-empty assistant answer")
        return prepend_system(messages, self.system)
