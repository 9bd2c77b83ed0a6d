"""GSM8K rewards: is the final number right, and is it given in the ``#### <number>`` form.

They pair with ``twinkle.preprocessor.GSM8KProcessor``, whose system prompt asks
for the answer on its own last line as ``#### <answer>`` and whose ``user_data``
carries ``answer`` (the reference number as a string).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.registry import register
from twinkle.reward.answers import NUMBER_PATTERN, boxed_answer, first_number, hash_answer, numbers_equal
from twinkle.reward.base import CompletionReward, required_field

_FINAL_LINE = re.compile(rf"####[ \t]*-?\$?-?(?:{NUMBER_PATTERN})\.?")


@register("reward")
class GSM8KAccuracyReward(CompletionReward):
    """1.0 when the completion's final number equals ``user_data[answer_key]``, else 0.0.

    The final answer is the first number on the line after the *last* ``####``;
    without a ``####``, the first number inside the last ``\\boxed{...}``.
    Numbers compare as values: ``18``, ``18.0``, ``$18`` and ``18.`` all match a
    reference of 18, ``1,800`` matches 1800, and a leading ``-`` (or ``−``) makes
    a number negative. The reference may be a number, a numeric string, or a
    full GSM8K solution ending in ``#### <n>``.
    """

    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key

    def score(self, completion: str, user_data: Mapping[str, Any]) -> float:
        reference = _reference_number(required_field(user_data, self.answer_key), self.answer_key)
        answer = hash_answer(completion) or boxed_answer(completion)
        predicted = first_number(answer) if answer is not None else None
        return float(predicted is not None and numbers_equal(predicted, reference))


@register("reward")
class GSM8KFormatReward(CompletionReward):
    """1.0 when the completion shows its reasoning and ends with a ``#### <number>`` line, else 0.0.

    The exact rule, after stripping trailing whitespace from the completion:

    * its last line, stripped, is ``####``, optional spaces, then one number
      (optional ``-`` and ``$``, digits with optional thousands commas and
      decimals, optional final ``.``) and nothing else; and
    * some non-whitespace text comes before that line (the reasoning).

    It ignores ``user_data``: format is independent of correctness, which
    :class:`GSM8KAccuracyReward` scores.
    """

    def score(self, completion: str, user_data: Mapping[str, Any]) -> float:
        reasoning, _, last_line = completion.rstrip().rpartition("\n")
        return float(bool(reasoning.strip()) and _FINAL_LINE.fullmatch(last_line.strip()) is not None)


def _reference_number(reference: Any, key: str) -> float:
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        value: float | None = float(reference)
    else:
        text = str(reference)
        value = first_number(hash_answer(text) or text)
    if value is None or not math.isfinite(value):
        raise InvalidInputError(f"user_data[{key!r}] must be a number, got {reference!r:.80}")
    return value
