"""The live replicas of each Serve application, as this process's request router last saw them.

Kept apart from ``router``: Serve pickles the router's module by value, so
state the engine must share with it lives in this module, imported by name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Listener = Callable[[list[str]], None]

_lock = threading.Lock()
_replicas: dict[str, list[str]] = {}  # application -> live replica ids
_listeners: dict[str, Listener] = {}


class ReplicaGoneError(RuntimeError):
    """A call was addressed to a replica that is no longer running."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(f"replica {replica_id} is no longer running")
        self.replica_id = replica_id


def publish(app: str, replica_ids: list[str]) -> None:
    """Record ``app``'s live replicas and tell its listener when the list changed."""
    with _lock:
        replica_ids = sorted(replica_ids)
        if _replicas.get(app) == replica_ids:
            return
        _replicas[app] = replica_ids
        listener = _listeners.get(app)
    if listener is not None:
        listener(replica_ids)


def subscribe(app: str, listener: Listener | None) -> None:
    """Call ``listener`` (on Serve's router thread: it must not block) with each new list; None forgets ``app``."""
    with _lock:
        if listener is None:
            _listeners.pop(app, None)
            _replicas.pop(app, None)
        else:
            _listeners[app] = listener
