"""What the Tinker API keeps in memory beside the shared server state: request order and sampling sessions.

A sampling session serves one set of weights: the base model, a saved sampler
checkpoint, or a snapshot of a run's adapter taken by an ephemeral
``save_weights_for_sampler``. Snapshots are sampler adapters of their own, so
a run that goes on training does not change what its earlier sampling clients
sample; each run keeps its newest ``MAX_SNAPSHOTS_PER_RUN`` (an RL loop makes
one per step), and a session whose snapshot was dropped says so. An
``inflight`` save instead refreshes one adapter per run that all of the run's
inflight sampling clients share, so they always sample its latest saved weights.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from twinkle.errors import ResourceNotFoundError
from twinkle.server.tinker.ordering import SeqGate

MAX_SNAPSHOTS_PER_RUN = 4


@dataclass(frozen=True)
class SamplingSession:
    id: str
    user: str
    base_model: str
    model_path: str | None  # the tinker:// path it was created from, if any
    adapter: str | None  # the sampler adapter serving it; None samples the base model
    run_id: str | None = None  # the run an ephemeral snapshot was taken from


class TinkerState:
    """Ordering gate, sampling sessions and the sampler adapters they use."""

    def __init__(self) -> None:
        self.gate = SeqGate()
        self._sessions: dict[str, SamplingSession] = {}
        self._snapshots: dict[str, OrderedDict[str, None]] = {}  # run id -> its snapshot adapters, oldest first
        self._inflight: dict[str, str] = {}  # run id -> the adapter its inflight sampling clients share
        self._loaded: set[tuple[str, int]] = set()  # (checkpoint adapter, replica) already in that replica's sampler
        self._lock = threading.Lock()

    def add_session(self, session: SamplingSession) -> None:
        with self._lock:
            self._sessions[session.id] = session

    def session(self, user: str, sampling_session_id: str) -> SamplingSession:
        with self._lock:
            session = self._sessions.get(sampling_session_id)
        if session is None or session.user != user:
            raise ResourceNotFoundError(f"no sampling session {sampling_session_id!r}")
        if session.adapter is not None and session.run_id is not None and not self.has_snapshot(session):
            raise ResourceNotFoundError(
                f"sampling session {sampling_session_id!r} served weights that were replaced by "
                f"{MAX_SNAPSHOTS_PER_RUN} newer saves of its run; save the weights for sampling again"
            )
        return session

    def has_snapshot(self, session: SamplingSession) -> bool:
        with self._lock:
            return session.adapter in self._snapshots.get(session.run_id or "", {}) or (
                session.adapter == self._inflight.get(session.run_id or "")
            )

    def add_inflight(self, run_id: str, adapter: str) -> None:
        with self._lock:
            self._inflight[run_id] = adapter

    def add_snapshot(self, run_id: str, adapter: str) -> list[str]:
        """Record a new snapshot of the run; returns the adapters now too old to keep (to drop from the sampler)."""
        with self._lock:
            snapshots = self._snapshots.setdefault(run_id, OrderedDict())
            snapshots[adapter] = None
            dropped = []
            while len(snapshots) > MAX_SNAPSHOTS_PER_RUN:
                dropped.append(snapshots.popitem(last=False)[0])
            return dropped

    def drop_run(self, run_id: str) -> list[str]:
        """Forget the run's snapshots (its adapter left the pool); returns the sampler adapters to drop."""
        with self._lock:
            inflight = self._inflight.pop(run_id, None)
            return [*self._snapshots.pop(run_id, {}), *([inflight] if inflight else [])]

    def is_loaded(self, adapter: str, replica: int = 0) -> bool:
        with self._lock:
            return (adapter, replica) in self._loaded

    def mark_loaded(self, adapter: str, replica: int = 0) -> bool:
        """Record that checkpoint adapter ``adapter`` is in ``replica``'s sampler; False if it already was."""
        with self._lock:
            if (adapter, replica) in self._loaded:
                return False
            self._loaded.add((adapter, replica))
            return True

    def forget_loaded(self, adapter: str) -> list[int]:
        """Its files changed or went: every replica must load it again; returns the replicas that had it."""
        with self._lock:
            replicas = sorted(replica for name, replica in self._loaded if name == adapter)
            self._loaded = {entry for entry in self._loaded if entry[0] != adapter}
        return replicas
