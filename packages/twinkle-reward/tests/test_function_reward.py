"""FunctionReward / @reward: plain functions as batch rewards, with checked results."""

from __future__ import annotations

import functools

import pytest

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Reward
from twinkle.reward import FunctionReward, reward


def test_completion_and_user_data_signature(make_sampled):
    @reward
    def mentions_answer(completion, user_data):
        return float(str(user_data["answer"]) in completion)

    assert isinstance(mentions_answer, Reward) and isinstance(mentions_answer, FunctionReward)
    batch = [make_sampled("... so 72 clips\n#### 72"), make_sampled("no idea")]
    assert mentions_answer(batch) == [1.0, 0.0]
    assert "mentions_answer" in repr(mentions_answer)


def test_trajectory_signature_sees_the_whole_row(make_sampled):
    def shorter_than_prompt(trajectory):
        prompt, completion = trajectory["messages"][-2]["content"], trajectory["messages"][-1]["content"]
        return float(len(completion) < len(prompt))

    rewarder = FunctionReward(shorter_than_prompt)
    assert rewarder.takes_trajectory
    assert rewarder([make_sampled("#### 72"), make_sampled("x" * 500)]) == [1.0, 0.0]


def test_signature_rules():
    def with_option(trajectory, *, scale=2.0):
        return scale

    def optional_ground_truth(completion, user_data=None):
        return 1.0

    assert FunctionReward(with_option).takes_trajectory
    assert not FunctionReward(optional_ground_truth).takes_trajectory
    assert not FunctionReward(lambda *args: 1.0).takes_trajectory
    assert FunctionReward(functools.partial(lambda weight, trajectory: weight, 0.5))([{"completion": ""}]) == [0.5]


def test_results_are_checked_and_name_the_index(make_sampled):
    batch = [make_sampled("a"), make_sampled("b")]
    for bad, message in [
        (float("nan"), "must be finite"),
        (float("inf"), "must be finite"),
        ("1.0", "must be a number, got str"),
        (None, "must be a number, got NoneType"),
    ]:
        scorer = FunctionReward(lambda completion, user_data, bad=bad: 1.0 if completion == "a" else bad)
        with pytest.raises(InvalidInputError, match=rf"FunctionReward: trajectories\[1\]: the reward {message}"):
            scorer(batch)
    assert FunctionReward(lambda completion, user_data: completion == "a")(batch) == [1.0, 0.0]  # bools are numbers


def test_unusable_functions_are_rejected():
    with pytest.raises(InvalidInputError, match="FunctionReward needs a callable"):
        FunctionReward("not callable")
    with pytest.raises(InvalidInputError, match=r"must take \(completion, user_data\) or \(trajectory\)"):
        FunctionReward(lambda: 1.0)
