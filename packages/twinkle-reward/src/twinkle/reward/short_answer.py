"""Short-answer accuracy (a word or a number), e.g. image questions from ``CLEVRProcessor``.

It pairs with ``twinkle.preprocessor.CLEVRProcessor``, whose prompt asks for one word or number and whose
``user_data`` carries ``answer``. Rewards for visual questions read only the text the model wrote, so this
scores any short-answer task the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from twinkle.registry import register
from twinkle.reward.answers import same_answer, stated_answer
from twinkle.reward.base import CompletionReward, required_field

_TRAILING = re.compile(r"[\s.!。]+$")


@register("reward")
class ShortAnswerReward(CompletionReward):
    """1.0 when the completion's answer is ``user_data[answer_key]``, else 0.0.

    The answer is the completion itself (a trailing period and surrounding spaces dropped), or what follows
    its last "answer is" / "answer:". It compares as :func:`twinkle.reward.same_answer` does: numerically when
    both read as numbers (``2``, ``2.0``), else case-insensitively (``Red`` is ``red``). Longer text that merely
    contains the answer ("red or blue") scores 0.
    """

    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key

    def score(self, completion: str, user_data: Mapping[str, Any]) -> float:
        reference = str(required_field(user_data, self.answer_key))
        text = completion.strip()
        answer = stated_answer(text) or text
        return float(same_answer(_TRAILING.sub("", answer.strip()), reference.strip()))
