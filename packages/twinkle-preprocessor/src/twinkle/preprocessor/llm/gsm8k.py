"""GSM8K rows (``{question, answer}``, the answer ending in ``#### <number>``) to math prompts."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, Trajectory
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.preprocessor.columns import text_column
from twinkle.registry import register

GSM8K_SYSTEM = (
    "You are a careful math assistant. Solve the problem step by step, then give the final answer "
    "on its own last line in the form '#### <answer>', where <answer> is only the number."
)
ANSWER_MARKER = "#### "
# GSM8K solutions annotate arithmetic for a calculator tool, e.g. "48/2 = <<48/2=24>>24".
_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


@register("preprocessor")
class GSM8KProcessor(Preprocessor):
    """Math word problems for RL (prompt only) or SFT warm-up (``include_solution=True``).

    ``user_data`` carries the reference for rewards: ``answer`` is the final
    number after ``####`` (thousands separators removed) and ``solution`` the
    full reference text. The assistant solution for SFT drops the calculator
    annotations, which the model could not have produced.
    """

    def __init__(self, system: str | None = GSM8K_SYSTEM, include_solution: bool = False) -> None:
        self.system = system
        self.include_solution = include_solution

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        name = type(self).__name__
        question = text_column(row, "question", name)
        solution = text_column(row, "answer", name)
        messages: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": question})
        if self.include_solution:
            messages.append({"role": "assistant", "content": _CALCULATOR_ANNOTATION.sub("", solution)})
        return {"messages": messages, "user_data": {"answer": _final_answer(solution, name), "solution": solution}}


def _final_answer(solution: str, processor: str) -> str:
    _, marker, answer = solution.rpartition(ANSWER_MARKER)
    answer = answer.strip().replace(",", "")
    if not marker or not answer:
        raise InvalidInputError(
            f"{processor}: column 'answer' must end with '{ANSWER_MARKER}<final answer>', got {solution[-80:]!r}"
        )
    return answer
