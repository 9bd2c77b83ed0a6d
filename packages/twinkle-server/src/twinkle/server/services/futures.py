"""Futures: the result of a long call, kept in the store and fetched by id with a long-poll.

The store is the source of truth (a future survives a restart, and one that
was in flight then reports a clear failure); in-memory wake-ups only rouse the
pollers waiting on a future of this process. Pollers wait on the event loop,
not in worker threads: a client that abandons long-polls must not use up the
threads that every other tenant's short calls need.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import partial
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


class Futures:
    """Create, finish and wait for futures owned by one user each."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._waiters: dict[str, list[Callable[[], object]]] = {}  # in-flight future id -> its pollers' wake-ups
        self._lock = threading.Lock()

    def create(self, user: str, method: str, run_id: str | None, idempotency_key: str | None) -> tuple[Future, bool]:
        """``(future, created)``; a repeated idempotency key returns the first call's future (nothing reruns)."""
        future, created = self.store.create_future(user, method, run_id=run_id, idempotency_key=idempotency_key)
        if created:
            with self._lock:
                self._waiters[future.id] = []
        return future, created

    def start(self, future_id: str) -> None:
        self.store.start_future(future_id)

    def resolve(self, future_id: str, result: Any) -> None:
        self.resolve_raw(future_id, wire.encode(result))

    def resolve_raw(self, future_id: str, payload: bytes) -> None:
        """Finish with an already encoded result (the Tinker API stores its replies as they are sent)."""
        self.store.finish_future(future_id, payload)
        self._wake(future_id)

    def fail(self, future_id: str, error: BaseException) -> None:
        self.store.fail_future(future_id, error_response(error)[1]["error"])
        self._wake(future_id)

    async def wait(self, user: str, future_id: str, timeout: float) -> Future:
        """The future once finished, or still pending after ``timeout`` seconds (0 to :data:`MAX_WAIT_S`; waiting
        holds no thread)."""
        timeout = min(timeout, MAX_WAIT_S) if timeout > 0 else 0.0  # NaN too
        future = self._get(user, future_id)
        if future.status not in ("pending", "running"):
            return future
        woken = asyncio.Event()
        wake = partial(asyncio.get_running_loop().call_soon_threadsafe, woken.set)  # _wake runs in another thread
        with self._lock:
            waiters = self._waiters.get(future_id)
            if waiters is None:  # it finished since the read above (or in a previous server process)
                return self._get(user, future_id)
            waiters.append(wake)
        try:
            await asyncio.wait_for(woken.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if wake in self._waiters.get(future_id, ()):
                    self._waiters[future_id].remove(wake)
        return self._get(user, future_id)

    def _get(self, user: str, future_id: str) -> Future:
        future = self.store.get_future(user, future_id)
        if future is None:
            raise ResourceNotFoundError(f"no future {future_id!r}")
        return future

    def _wake(self, future_id: str) -> None:
        with self._lock:
            waiters = self._waiters.pop(future_id, [])
        for wake in waiters:
            wake()
