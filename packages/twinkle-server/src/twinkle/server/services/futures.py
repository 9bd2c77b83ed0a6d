"""Futures: the result of a long call, kept in the store and fetched by id with a long-poll.

The store is the source of truth (a future survives a restart, and one that
was in flight then reports a clear failure); the pollers waiting on a future of
this process are woken with the future as it was stored. Pollers wait on the event loop,
not in worker threads: a client that abandons long-polls must not use up the
threads that every other tenant's short calls need.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from twinkle import wire
from twinkle.errors import ResourceNotFoundError
from twinkle.server.errors import error_response
from twinkle.server.store import Store
from twinkle.server.store.base import Future

MAX_WAIT_S = 60.0  # the longest a request may wait for a future: proxies drop idle connections after a minute or so


def api_method(api: str, method: str) -> str:
    """The method name a future of another API than the native one is stored under (``"tinker.forward"``)."""
    return f"{api}.{method}"


def api_of(method: str) -> str | None:
    """The API a future's method belongs to: ``None`` for the native API, else the prefix of :func:`api_method`."""
    api, dot, _ = method.partition(".")
    return api if dot else None


@dataclass
class _InFlight:
    """A future of this process still running: as created, and its pollers' wake-ups (handed the finished
    future, or None when the store had it finished already)."""

    future: Future
    wakes: list[Callable[[Future | None], object]] = field(default_factory=list)


class Futures:
    """Create, finish and wait for futures owned by one user each."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._in_flight: dict[str, _InFlight] = {}
        self._lock = threading.Lock()

    def create(self, user: str, method: str, run_id: str | None, idempotency_key: str | None) -> tuple[Future, bool]:
        """``(future, created)``; a repeated idempotency key returns the first call's future (nothing reruns)."""
        future, created = self.store.create_future(user, method, run_id=run_id, idempotency_key=idempotency_key)
        if created:
            with self._lock:
                self._in_flight[future.id] = _InFlight(future)
        return future, created

    def resolve(self, future_id: str, result: Any) -> None:
        self.resolve_raw(future_id, wire.encode(result))

    def resolve_raw(self, future_id: str, payload: bytes) -> None:
        """Finish with an already encoded result (the Tinker API stores its replies as they are sent)."""
        finished_at = self.store.finish_future(future_id, payload)
        self._settle(future_id, finished_at, status="done", result=payload)

    def fail(self, future_id: str, error: BaseException) -> None:
        body = error_response(error)[1]["error"]
        finished_at = self.store.fail_future(future_id, body)
        self._settle(future_id, finished_at, status="failed", error=body)

    async def wait(self, user: str, future_id: str, timeout: float) -> Future:
        """The future once finished, or still pending after ``timeout`` seconds (0 to :data:`MAX_WAIT_S`; waiting
        holds no thread).

        A poller of a future of this process is handed the finished future as it is stored, without reading
        it back: every training call's reply waits so, and those two reads of the store were a tenth of its time.
        """
        timeout = min(timeout, MAX_WAIT_S) if timeout > 0 else 0.0  # NaN too
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        finished: list[Future | None] = []

        def woke(future: Future | None) -> None:
            finished.append(future)
            woken.set()

        def wake(future: Future | None) -> None:  # runs in the thread that finished the future
            loop.call_soon_threadsafe(woke, future)

        with self._lock:
            entry = self._in_flight.get(future_id)
            if entry is None or entry.future.user != user or timeout == 0:
                entry = None  # finished, not this user's, or no wait: as stored
            else:
                entry.wakes.append(wake)
        if entry is None:
            return self._get(user, future_id)
        try:
            await asyncio.wait_for(woken.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if wake in entry.wakes:
                    entry.wakes.remove(wake)
        if finished and finished[0] is not None:
            return finished[0]
        return self._get(user, future_id)

    def _get(self, user: str, future_id: str) -> Future:
        future = self.store.get_future(user, future_id)
        if future is None:
            raise ResourceNotFoundError(f"no future {future_id!r}")
        return future

    def _settle(self, future_id: str, finished_at: float | None, **outcome: Any) -> None:
        with self._lock:
            entry = self._in_flight.pop(future_id, None)
        if entry is None:
            return
        future = None if finished_at is None else replace(entry.future, finished_at=finished_at, **outcome)
        for wake in entry.wakes:
            wake(future)
