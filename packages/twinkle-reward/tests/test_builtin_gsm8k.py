"""End to end with the GSM8K preprocessor and the builtin gsm8k-mini data (skipped when those are not installed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward, MathAnswerReward

hub = pytest.importorskip("twinkle.hub")
preprocessor = pytest.importorskip("twinkle.preprocessor")


def _answered(rows, solutions):
    """Trajectories as GSM8KProcessor makes them, answered with the given solution texts."""
    trajectories = []
    for row, solution in zip(rows, solutions, strict=True):
        trajectory = preprocessor.GSM8KProcessor()(row)
        trajectory["messages"].append({"role": "assistant", "content": solution})
        trajectories.append(trajectory)
    return trajectories


def test_reference_solutions_score_full_marks_and_others_do_not():
    path = Path(hub.resolve_dataset("builtin://gsm8k-mini")) / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    answers = [row["answer"].rpartition("####")[2].strip() for row in rows]

    reference = _answered(rows, [row["answer"] for row in rows])
    for reward in (GSM8KAccuracyReward(), GSM8KFormatReward(), MathAnswerReward()):
        assert reward(reference) == [1.0] * len(rows)

    shifted = _answered(rows, [row["answer"] for row in rows[1:] + rows[:1]])  # each gets its neighbour's solution
    neighbours = answers[1:] + answers[:1]
    expected = [float(answer == neighbour) for answer, neighbour in zip(answers, neighbours, strict=True)]
    assert GSM8KAccuracyReward()(shifted) == expected
    assert sum(expected) < len(rows) / 2
    assert GSM8KFormatReward()(shifted) == [1.0] * len(rows)
