"""MathAnswerReward on MATH-style completions and references."""

from __future__ import annotations

import pytest

from twinkle.errors import InvalidInputError
from twinkle.reward import MathAnswerReward


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("Simplifying, $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
        ("Simplifying, $x = \\boxed{0.5}$.", "\\dfrac{1}{2}", 1.0),
        ("So $x = \\boxed{\\frac{1}{3}}$.", "0.33", 0.0),
        ("The roots are \\boxed{(1, -2)}.", "(1,-2)", 1.0),
        ("The day is \\boxed{\\text{Tuesday}}.", "Tuesday", 1.0),
        ("The angle is \\boxed{90^\\circ}.", "90", 1.0),
        ("Adding up: 3 + 4 = 7.\n#### 7", "7", 1.0),
        ("Adding up gives 7, so the answer is 7.", "7", 1.0),
        ("Final answer: 1,024", "1024", 1.0),
        ("The answer is 12. Wait, recount: the answer is 13.", "13", 1.0),
        ("Expanding, we get \\boxed{x^2 + 2x + 1}.", "x^2+2x+1", 1.0),
        ("Expanding, we get \\boxed{x^2 + 2x + 1}.", "(x+1)^2", 0.0),
        ("I could not solve it.", "7", 0.0),
        ("", "7", 0.0),
        # The reference may be a whole worked solution: its own final answer is used.
        ("So \\boxed{6}.", "Since 2*3 = 6, the area is $\\boxed{6}$.", 1.0),
        ("So \\boxed{6}.", "2*3 = 6\n#### 6", 1.0),
    ],
)
def test_math_answers(completion, reference, expected):
    rows = [{"messages": [{"role": "assistant", "content": completion}], "user_data": {"answer": reference}}]
    assert MathAnswerReward()(rows) == [expected]


def test_numeric_reference_and_custom_key():
    rows = [{"completion": "\\boxed{42}", "user_data": {"solution": 42}}]
    assert MathAnswerReward(answer_key="solution")(rows) == [1.0]
    with pytest.raises(InvalidInputError, match=r"MathAnswerReward: trajectories\[0\]: user_data has no 'answer'"):
        MathAnswerReward()(rows)
