"""Alpaca rows (``{instruction, input?, output, system?}``) to chats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Trajectory
from twinkle.interfaces import Preprocessor
from twinkle.preprocessor.columns import text_column
from twinkle.preprocessor.llm.messages import prepend_system
from twinkle.registry import register


@register("preprocessor")
class AlpacaProcessor(Preprocessor):
    """The user turn is the instruction, followed by the ``input`` after a blank line when there is one.

    A row's own ``system`` column wins over the ``system`` given here.
    """

    def __init__(self, system: str | None = None) -> None:
        self.system = system

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        name = type(self).__name__
        instruction = text_column(row, "instruction", name)
        extra_input = text_column(row, "input", name, required=False)
        query = f"{instruction}\n\n{extra_input}" if extra_input.strip() else instruction
        output = text_column(row, "output", name)
        system = text_column(row, "system", name, required=False) or self.system
        messages = prepend_system(
            [{"role": "user", "content": query}, {"role": "assistant", "content": output}], system
        )
        return {"messages": messages}
