"""CompletionRewardMetric: the seed's usage, statistics against numpy, accumulation and reset."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.errors import InvalidInputError
from twinkle.metric import CompletionRewardMetric


def test_seed_usage_keys_and_values():
    metric = CompletionRewardMetric()
    metric.accumulate(
        completion_lengths=[120, 87, 240, 64],
        rewards={"total": [2.0, 1.0, 0.0, 2.0], "format": [1.0, 1.0, 0.0, 1.0], "accuracy": [1.0, 0.0, 0.0, 1.0]},
    )
    result = metric.calculate()
    assert set(result) == {
        *(f"reward/{name}/{stat}" for name in ("total", "format", "accuracy") for stat in ("mean", "std")),
        "completion_length/mean",
        "completion_length/max",
        "completion_length/min",
        "num_completions",
    }
    assert result["reward/total/mean"] == pytest.approx(1.25)
    assert result["reward/total/std"] == pytest.approx(np.std([2.0, 1.0, 0.0, 2.0]))
    assert result["reward/accuracy/mean"] == pytest.approx(0.5)
    assert result["completion_length/mean"] == pytest.approx(127.75)
    assert (result["completion_length/max"], result["completion_length/min"]) == (240.0, 64.0)
    assert result["num_completions"] == 4
    assert all(isinstance(value, float) for value in result.values())


def test_accumulates_across_batches_until_reset():
    rng = np.random.default_rng(0)
    metric = CompletionRewardMetric()
    rewards, lengths = rng.normal(size=(3, 8)), rng.integers(1, 500, size=(3, 8))
    for batch_rewards, batch_lengths in zip(rewards, lengths, strict=True):
        metric.accumulate(completion_lengths=batch_lengths, rewards={"total": batch_rewards})
    result = metric.calculate()
    assert result["reward/total/mean"] == pytest.approx(rewards.mean())
    assert result["reward/total/std"] == pytest.approx(rewards.std())
    assert result["completion_length/mean"] == pytest.approx(lengths.mean())
    assert result["num_completions"] == 24
    assert metric.calculate() == result  # calculate does not consume
    metric.reset()
    assert metric.calculate() == {}


def test_plain_list_is_total_and_either_argument_alone_works():
    metric = CompletionRewardMetric()
    metric.accumulate(rewards=np.array([1.0, 0.0]))
    assert metric.calculate() == {"reward/total/mean": 0.5, "reward/total/std": 0.5, "num_completions": 2.0}
    metric.reset()
    metric.accumulate(completion_lengths=[3, 5])
    assert metric.calculate() == {
        "completion_length/mean": 4.0,
        "completion_length/max": 5.0,
        "completion_length/min": 3.0,
        "num_completions": 2.0,
    }
    metric.accumulate(completion_lengths=[], rewards={"total": []})  # an empty batch changes nothing
    assert metric.calculate()["num_completions"] == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs completion_lengths and/or rewards"),
        ({"rewards": {}}, "rewards must name at least one reward"),
        (
            {"rewards": {"total": [1.0, 0.0], "format": [1.0]}},
            r"rewards\['total'\] has 2 values but rewards\['format'\]",
        ),
        ({"completion_lengths": [1, 2, 3], "rewards": [1.0, 0.0]}, "has 2 values but completion_lengths has 3"),
        ({"rewards": {"accuracy": [1.0, float("nan")]}}, r"rewards\['accuracy'\]\[1\] is nan"),
        ({"completion_lengths": [4, -1]}, "completion_lengths must be >= 0"),
        ({"rewards": "high"}, "rewards must be a list of numbers, got str"),
    ],
)
def test_bad_inputs(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        CompletionRewardMetric().accumulate(**kwargs)


def test_a_rejected_batch_leaves_the_state_unchanged():
    metric = CompletionRewardMetric()
    metric.accumulate(rewards=[1.0])
    with pytest.raises(InvalidInputError):
        metric.accumulate(completion_lengths=[1, 2], rewards={"total": [0.0, 0.0], "format": [0.0]})
    assert metric.calculate()["num_completions"] == 1.0
