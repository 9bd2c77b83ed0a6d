"""``MathAnswerReward``: final-answer accuracy for math datasets beyond GSM8K (MATH, AIME, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.registry import register
from twinkle.reward.answers import boxed_answer, hash_answer, same_answer, stated_answer
from twinkle.reward.base import CompletionReward, required_field


def final_answer(text: str) -> str | None:
    """A solution's final answer: the last ``\\boxed{}``, else the last ``####`` line, else "answer is X"."""
    return boxed_answer(text) or hash_answer(text) or stated_answer(text)


@register("reward")
class MathAnswerReward(CompletionReward):
    """1.0 when the completion's final answer equals ``user_data[answer_key]``, else 0.0.

    Both sides go through :func:`final_answer` (a reference without any marker is
    taken whole), then compare numerically when both read as numbers
    (``0.5 == 1/2 == \\frac{1}{2}``, ``1,000 == 1000``) and as normalised strings
    otherwise (LaTeX spacing, ``$``, ``\\text{}``, ``\\left``/``\\right`` and case
    ignored). Equivalent but differently written expressions (``x+1`` vs ``1+x``)
    are not recognised.
    """

    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key

    def score(self, completion: str, user_data: Mapping[str, Any]) -> float:
        reference = str(required_field(user_data, self.answer_key))
        return float(same_answer(final_answer(completion), final_answer(reference) or reference))
