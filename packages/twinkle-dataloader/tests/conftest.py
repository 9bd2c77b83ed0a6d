"""Fixtures for the dataloader tests: a simulated torchrun process."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from twinkle.infra import DeviceGroup, Runtime, initialize


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Runtime]]:
    """``torchrun(rank, world_size, groups=None)`` makes this process look like one torchrun worker."""

    def start(rank: int, world_size: int, groups: list[DeviceGroup] | None = None) -> Runtime:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        return initialize("local", groups=groups)

    yield start
    monkeypatch.undo()
    initialize("local")  # back to a single-process runtime for the next test
