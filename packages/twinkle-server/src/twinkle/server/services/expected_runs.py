"""Which runs a shared pass waits for: tenants of recent passes on their way back with their next training call.

A tenant trains in a loop: a training call, then its optimizer step, each a
round trip. After a pass, its runs are expected back; a run is *on its way*
until it has run a second other call since its pass (then it is doing
something else). A pass may wait for each expected run at most ``wait_s`` of
idle time until it trains again, so a tenant gone away costs one wait. After a
pause (the worker had nothing to do for ``PAUSE_S``), the runs of the last
``REMEMBERED_PASSES`` passes are expected afresh, each once a run it last shared
a pass with is back: tenants that stopped together (the end of an epoch, an
evaluation) are waited for when they start again, even those a pass waited out
just before the pause, while tenants that trained apart from those back (another
group, now idle) are not.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Set
from dataclasses import dataclass

REMEMBERED_PASSES = 16
PAUSE_S = 1.0


@dataclass
class _Expected:
    last_pass: int  # the number of the run's last pass
    calls: int = 0  # its other calls run since
    waited: float = 0.0  # idle seconds passes have waited for it since
    partners: frozenset[str] = frozenset()  # the runs of its last pass shared with other runs


class ExpectedRuns:
    """The bookkeeping of the scheduler's worker (which holds its lock around every call)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._passes = 0
        self._runs: dict[str, _Expected] = {}
        self._resumed = False  # paused, and no pass since: only the partners of the runs back are expected
        self._last_batch: frozenset[str] = frozenset()  # the runs of the last pass

    def trained(self, batch: Iterable[str]) -> None:
        """A pass of ``batch`` starts: its runs are expected back; runs of older passes are forgotten."""
        self._passes += 1
        keys = self._last_batch = frozenset(batch)
        if self._resumed:  # the first pass since a pause: runs that trained apart from its runs stay idle
            back = keys.union(*(self._runs[key].partners for key in keys if key in self._runs))
            for key, run in self._runs.items():
                if key not in back:
                    run.waited = self.wait_s
            self._resumed = False
        for key in keys:
            previous = self._runs.get(key)
            partners = keys if len(keys) > 1 else previous.partners if previous else frozenset()
            self._runs[key] = _Expected(self._passes, partners=partners)
        oldest = self._passes - REMEMBERED_PASSES
        self._runs = {key: run for key, run in self._runs.items() if run.last_pass > oldest}

    def ran_call(self, key: str) -> None:
        """``key`` ran a call other than a training call."""
        if key in self._runs:
            self._runs[key].calls += 1

    def awaited(self, ready: Set[str], queued: Container[str]) -> list[str]:
        """The expected runs on their way and not waited out, other than ``ready`` (with a training call
        queued); ``queued``: the runs with any call queued."""
        wanted: Container[str] = self._runs
        if self._resumed:
            wanted = frozenset().union(*(self._runs[key].partners for key in ready if key in self._runs))
        return [
            key
            for key, run in self._runs.items()
            if key not in ready
            and key in wanted
            and run.waited < self.wait_s
            and (run.calls == 0 or (run.calls == 1 and key not in queued))  # before its step, or after it
        ]

    def stepping(self, queued: Container[str]) -> list[str]:
        """The runs of the last pass, when it was shared, on their way with their step: no other call run since
        the pass, none queued (``queued``), not waited out. Empty after a pause."""
        if self._resumed or len(self._last_batch) < 2:
            return []
        return [
            key
            for key in self._last_batch
            if self._runs[key].calls == 0 and key not in queued and self._runs[key].waited < self.wait_s
        ]

    def in_last_pass(self, key: str) -> bool:
        return key in self._last_batch

    def wait_left(self, keys: Iterable[str]) -> float:
        """How long a pass may still wait for the first of ``keys`` to be waited out."""
        return min(self.wait_s - self._runs[key].waited for key in keys)

    def waited(self, keys: Iterable[str], seconds: float) -> None:
        for key in keys:
            self._runs[key].waited += seconds

    def paused(self) -> None:
        """The worker had nothing to do for ``PAUSE_S``: every remembered run is expected afresh, by its partners."""
        for run in self._runs.values():
            run.calls, run.waited = 0, 0.0
        self._resumed = True
