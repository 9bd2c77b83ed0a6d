"""Fixtures shared by the server's unit tests."""

from __future__ import annotations

import pytest


class FakeClock:
    """A clock the test moves by hand (``clock.now += 5``), for expiry and session timeouts."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
