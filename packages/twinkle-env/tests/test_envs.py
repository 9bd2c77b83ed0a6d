"""The built-in environments and the calculator's arithmetic, without a model."""

from __future__ import annotations

from fractions import Fraction

import pytest

from twinkle.env import CalculatorEnv, EnvGroup, ExpressionError, GuessNumberEnv, evaluate
from twinkle.errors import InvalidInputError
from twinkle.registry import build


@pytest.mark.parametrize(
    ("expression", "value"),
    [("417 * 38", 15846), ("3*(4+5)/2", Fraction(27, 2)), ("-2 ** 3", -8), ("7 // 2 + 7 % 2", 4), ("1.5 × 4", 6)],
)
def test_arithmetic_is_exact(expression: str, value: Fraction) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os')", "only numbers"),
        ("1 / 0", "division by zero"),
        ("2 ** 1000", "exponents"),
        ("9" * 201, "longer than"),
        ("1 +", "cannot parse"),
        ("1 << 3", "not supported"),
    ],
)
def test_arithmetic_refuses_what_is_not_plain_arithmetic(expression: str, problem: str) -> None:
    with pytest.raises(ExpressionError, match=problem):
        evaluate(expression)


def test_calculator_episode_with_the_tool() -> None:
    env = CalculatorEnv()
    (question,) = env.reset(seed=3)
    expression = question["content"].removeprefix("What is ").removesuffix("?")
    answer = str(evaluate(expression))
    call = {"name": "calculator", "arguments": {"expression": expression}}
    step = env.step({"role": "assistant", "content": "", "tool_calls": [call, {"name": "web", "arguments": {}}]})
    assert not step.done
    assert [m["content"] for m in step.messages] == [answer, "error: unknown tool 'web'; use calculator"]
    final = env.step({"role": "assistant", "content": f"The answer is {answer}."})
    assert (final.done, final.reward, final.info["tool_calls"], final.info["correct"]) == (True, 1.0, 2, True)


def test_calculator_wrong_answer_and_bad_expression() -> None:
    env = CalculatorEnv(low=1, high=9, operators="+")
    env.reset(seed=0)
    bad = env.step({"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": {}}]})
    assert bad.messages[0]["content"].startswith("error: the expression must be a string")
    assert env.step({"role": "assistant", "content": "It is 1000."}).reward == 0.0
    assert env.reset(seed=0) == CalculatorEnv(low=1, high=9, operators="+").reset(seed=0)  # the seed draws the task


def test_guessing_game_feedback_and_reward() -> None:
    env = GuessNumberEnv(low=1, high=100, max_guesses=4)
    env.reset(seed=5)
    secret = env.secret
    assert env.step({"role": "assistant", "content": f"{secret - 1}"}).messages[0]["content"] == "Higher."
    assert env.step({"role": "assistant", "content": "no idea"}).messages[0]["content"] == "Answer with one number."
    found = env.step({"role": "assistant", "content": f"Is it {secret}?"})
    assert (found.done, found.reward) == (True, 1.0 - 2 / 4)
    env.reset(seed=5)
    for _ in range(3):
        assert not env.step({"role": "assistant", "content": f"{secret + 1}"}).done
    assert (lambda s: (s.done, s.reward))(env.step({"role": "assistant", "content": "0"})) == (True, 0.0)


def test_env_group_copies_one_task_by_name() -> None:
    group = EnvGroup("CalculatorEnv", group_size=3, seed=7, low=10, high=20)
    assert len(group) == 3 and all(isinstance(env, CalculatorEnv) and env.high == 20 for env in group.envs)
    assert len({id(env) for env in group.envs}) == 3
    assert isinstance(build("env", "GuessNumberEnv"), GuessNumberEnv)  # published as an entry point
    with pytest.raises(InvalidInputError, match="group_size"):
        EnvGroup("CalculatorEnv", group_size=0, seed=0)
    with pytest.raises(InvalidInputError, match="operators"):
        CalculatorEnv(operators="/")
