"""Batches for training loops: :class:`DataLoader` over any sized dataset, in plain Python (no torch).

A torch-free client can iterate and checkpoint data; collation into tensors
is the optional ``processor``'s job.
"""

from twinkle.dataloader.loader import DataLoader
from twinkle.dataloader.state import LoaderState

__all__ = ["DataLoader", "LoaderState"]
