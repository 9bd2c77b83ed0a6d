"""The shared batch loop (input checks), registry and entry points, and the torch/numpy-free import."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Reward
from twinkle.registry import build, get_registry
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward, completion_text

BUILTINS = ["FunctionReward", "GSM8KAccuracyReward", "GSM8KFormatReward", "MathAnswerReward"]


def test_completion_text_sources():
    assert completion_text({"completion": "direct", "messages": [{"role": "assistant", "content": "ignored"}]}) == (
        "direct"
    )
    assert completion_text({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    assert (
        completion_text({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}) == ""
    )
    assert completion_text({"messages": []}) == ""


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ("#### 72", "expects a list of trajectories, got str"),
        ({"messages": []}, "expects a list of trajectories, got dict"),
        ([{"completion": "x", "user_data": {"answer": 1}}, "#### 72"], r"trajectories\[1\] must be a dict"),
        ([None], r"trajectories\[0\] must be a dict with 'messages' and 'user_data', got NoneType"),
        ([{"user_data": {"answer": 1}}], r"trajectories\[0\]: has no 'messages' or 'completion' key"),
        ([{"completion": 72, "user_data": {"answer": 1}}], r"'completion' must be a string, got int"),
        ([{"messages": "hello", "user_data": {"answer": 1}}], "'messages' must be a list of messages"),
        (
            [{"messages": [{"role": "assistant", "content": None}], "user_data": {"answer": 1}}],
            "assistant message's content must be a string, got NoneType",
        ),
        ([{"completion": "x", "user_data": ["72"]}], r"'user_data' must be a dict, got list"),
    ],
)
def test_bad_batches_raise_naming_the_problem(batch, message):
    with pytest.raises(InvalidInputError, match=message):
        GSM8KAccuracyReward()(batch)


def test_accepts_any_sequence_of_mappings():
    rows = ({"completion": "ok\n#### 1", "user_data": {"answer": 1}},)
    assert GSM8KAccuracyReward()(rows) == [1.0]


def test_builtins_resolve_by_name_and_entry_point():
    published = {ep.name: ep for ep in entry_points(group="twinkle.reward")}
    assert set(BUILTINS) <= set(published)
    for name in BUILTINS:
        assert published[name].load() is get_registry("reward").get(name)
    accuracy = build("reward", "GSM8KAccuracyReward", answer_key="target")
    assert isinstance(accuracy, GSM8KAccuracyReward) and accuracy.answer_key == "target"
    assert isinstance(build("reward", GSM8KFormatReward), Reward)


def test_seed_compute_rewards_shape():
    """The GRPO seed sums accuracy and format rewards element-wise."""
    rows = [
        {"completion": "24 + 48 = 72\n#### 72", "user_data": {"answer": "72"}},
        {"completion": "24 + 48 = 70\n#### 70", "user_data": {"answer": "72"}},
        {"completion": "it is 72", "user_data": {"answer": "72"}},
    ]
    accuracy, fmt = GSM8KAccuracyReward()(rows), GSM8KFormatReward()(rows)
    assert [a + f for a, f in zip(accuracy, fmt, strict=True)] == [2.0, 1.0, 0.0]


def test_import_needs_neither_torch_nor_numpy():
    code = (
        "import sys, twinkle.reward\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
