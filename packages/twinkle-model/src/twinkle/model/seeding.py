"""Seeded draws from torch's RNG that leave the global RNG as it was (e.g. a new adapter's initial weights)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from twinkle.errors import ConfigurationError


@contextmanager
def seeded(seed: int | None) -> Iterator[None]:
    """Draw from torch's RNG seeded with ``seed`` inside the block, restoring the global RNG after (no-op for None)."""
    if seed is None:
        yield
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigurationError(f"seed must be an int, got {seed!r}")
    cuda = torch.cuda.is_initialized()  # seeding CUDA before it starts would seed it when it starts, after this block
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
        (torch.manual_seed if cuda else torch.default_generator.manual_seed)(seed)
        yield
