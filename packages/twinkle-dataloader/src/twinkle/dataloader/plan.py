"""Which rows make up each batch of an epoch: a deterministic order, cut into batches."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """How one epoch of ``num_samples`` rows splits into batches of ``batch_size``.

    Only the last batch can be short; it is kept when it has at least
    ``min_batch_size`` rows, so every epoch has the same batches.
    """

    num_samples: int
    batch_size: int
    min_batch_size: int

    @property
    def num_batches(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + int(rest > 0 and rest >= self.min_batch_size)

    def batch(self, order: list[int], index: int) -> list[int]:
        """The dataset indices of batch ``index`` of an epoch whose row order is ``order``."""
        start = index * self.batch_size
        return order[start : start + self.batch_size]

    def size_of(self, index: int) -> int:
        """The number of rows in batch ``index`` (``batch_size`` except perhaps for the last)."""
        return min(self.batch_size, self.num_samples - index * self.batch_size)


def epoch_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The row order of ``epoch``: a permutation that depends only on ``(seed, epoch)``.

    Seeding with a string is stable across processes and Python runs (unlike
    ``hash``), so every rank and every resumed run computes the same order.
    """
    order = list(range(num_samples))
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(order)
    return order
