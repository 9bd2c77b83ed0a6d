"""Shared fixtures: trajectories shaped like a sampler's ``new_input_feature``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest

# The builtin datasets are built once per test session, never into the user's cache.
os.environ.setdefault("TWINKLE_CACHE_DIR", tempfile.mkdtemp(prefix="twinkle-reward-test-"))

QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?"


def sampled(completion: str, answer: Any = "72", **extra: Any) -> dict[str, Any]:
    """A feature as the sampler returns it: prompt messages + the completion, ids, and the ground truth."""
    return {
        "input_ids": [1, 2, 3],
        "messages": [
            {"role": "system", "content": "Solve step by step; end with '#### <answer>'."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": completion},
        ],
        "user_data": {"answer": answer, **extra},
    }


@pytest.fixture
def make_sampled():
    return sampled
