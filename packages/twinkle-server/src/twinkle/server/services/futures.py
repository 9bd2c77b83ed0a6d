"""Futures: the result of a long call, kept in the store and fetched by id with a long-poll.

The store is the source of truth (a future survives a restart, and one that
was in flight then reports a clear failure); in-memory events only wake the
pollers waiting on a future of this process.
"""

from __future__ import annotations

import threading
from typing import Any

from twinkle import wire
from twinkle.errors import ResourceNotFoundError
from twinkle.server.errors import error_response
from twinkle.server.store import Store
from twinkle.server.store.base import Future


class Futures:
    """Create, finish and wait for futures owned by one user each."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def create(self, user: str, method: str, run_id: str | None, idempotency_key: str | None) -> tuple[Future, bool]:
        """``(future, created)``; a repeated idempotency key returns the first call's future (nothing reruns)."""
        future, created = self.store.create_future(user, method, run_id=run_id, idempotency_key=idempotency_key)
        if created:
            with self._lock:
                self._events[future.id] = threading.Event()
        return future, created

    def start(self, future_id: str) -> None:
        self.store.start_future(future_id)

    def resolve(self, future_id: str, result: Any) -> None:
        self.store.finish_future(future_id, wire.encode(result))
        self._wake(future_id)

    def fail(self, future_id: str, error: BaseException) -> None:
        self.store.fail_future(future_id, error_response(error)[1]["error"])
        self._wake(future_id)

    def wait(self, user: str, future_id: str, timeout: float) -> Future:
        """The future once finished, or still pending after ``timeout`` seconds."""
        future = self.store.get_future(user, future_id)
        if future is None:
            raise ResourceNotFoundError(f"no future {future_id!r}")
        if future.status in ("pending", "running"):
            with self._lock:
                event = self._events.get(future_id)
            if event is not None and event.wait(timeout):
                future = self.store.get_future(user, future_id) or future
        return future

    def _wake(self, future_id: str) -> None:
        with self._lock:
            event = self._events.pop(future_id, None)
        if event is not None:
            event.set()
