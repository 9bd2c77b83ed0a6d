"""ShortAnswerReward: one word or number, as CLEVRProcessor's prompts ask for."""

from __future__ import annotations

import pytest

from twinkle.errors import InvalidInputError
from twinkle.registry import build
from twinkle.reward import ShortAnswerReward


def _row(completion: str, answer: str) -> dict:
    return {"messages": [{"role": "assistant", "content": completion}], "user_data": {"answer": answer}}


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("red", "red", 1.0),
        (" Red.\n", "red", 1.0),
        ("2", "2", 1.0),
        ("2.0", "2", 1.0),
        ("The answer is 3.", "3", 1.0),
        ("answer: circle", "circle", 1.0),
        ("3", "2", 0.0),
        ("blue", "red", 0.0),
        ("red or blue", "red", 0.0),
        ("", "0", 0.0),
        ("two", "2", 0.0),
    ],
)
def test_scores_short_answers(completion: str, answer: str, expected: float) -> None:
    assert ShortAnswerReward()([_row(completion, answer)]) == [expected]


def test_registered_and_names_a_missing_answer() -> None:
    reward = build("reward", "ShortAnswerReward")
    assert reward([_row("1", "1")]) == [1.0]
    with pytest.raises(InvalidInputError, match="answer"):
        reward([{"completion": "square", "user_data": {"label": "square"}}])
