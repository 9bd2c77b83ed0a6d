"""Peak memory of a block of work above what was in use when it began, on CUDA or on a Linux CPU.

On CUDA it is ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: what torch's allocator
handed out. On CPU torch keeps no allocator statistics and tracemalloc does not see its allocations, so it is
the peak resident set (``VmHWM`` in ``/proc/self/status``, reset by writing 5 to ``/proc/self/clear_refs``)
minus the resident set before. Large tensors are mapped and unmapped on their own, so this follows the live
tensors to within the allocator's slack.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PeakMemory", "peak_memory"]


class PeakMemory:
    """``bytes``: the peak above the start, set when the block ends."""

    bytes: int = 0


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"no {field} in /proc/self/status")


@contextmanager
def peak_memory(device: torch.device) -> Iterator[PeakMemory]:
    """``with peak_memory(device) as peak: ...`` then ``peak.bytes``."""
    result = PeakMemory()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current resident set
        before = _rss_bytes("VmRSS")
    yield result
    if cuda:
        torch.cuda.synchronize()
    result.bytes = (torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM")) - before
