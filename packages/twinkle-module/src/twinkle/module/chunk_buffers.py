"""Reused CPU buffers for the chunked log-probabilities' ``[chunk, V]`` logits.

A CPU tensor of a gigabyte comes from the kernel as fresh pages on every
allocation: a pass over 2,000 positions of a 151,936-token vocabulary faults in
1.2 GB (about 300,000 page faults, 18% of such a pass on a two-core VM, and
the part of its time that varies most with the machine's memory state).
Keeping freed buffers for the next pass removes that cost, as CUDA's caching
allocator already does on a GPU, so only CPU buffers are kept. A buffer is
kept only while no pass uses it, and the free ones together stay under
``max_free_bytes``, so a process holds at most that much beyond its peak.
"""

from __future__ import annotations

import threading

import torch

DEFAULT_MAX_FREE_BYTES = 2 << 30


class ChunkBuffers:
    """Free buffers by dtype; :meth:`take` hands out the smallest that fits, :meth:`give` takes it back."""

    def __init__(self, max_free_bytes: int = DEFAULT_MAX_FREE_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()  # passes of different models may run on different threads

    def take(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU ``[rows, cols]`` tensor of ``dtype`` with arbitrary contents, owned by the caller
        until it :meth:`give` s back the same tensor."""
        numel = rows * cols
        with self._lock:
            fitting = [i for i, buffer in enumerate(self._free) if buffer.dtype == dtype and buffer.numel() >= numel]
            if fitting:
                buffer = self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
                return buffer[:numel].view(rows, cols)
        return torch.empty(rows, cols, dtype=dtype)

    def give(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s storage for a later :meth:`take` (the caller must not use it any more)."""
        whole = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage())
        with self._lock:
            self._free.append(whole)
            self._free.sort(key=lambda buffer: buffer.nbytes, reverse=True)  # the largest are worth keeping
            while sum(buffer.nbytes for buffer in self._free) > self.max_free_bytes:
                self._free.pop()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(buffer.nbytes for buffer in self._free)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
