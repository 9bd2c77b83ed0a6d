"""Running each Tinker model's requests in ``seq_id`` order, whatever order they arrive in.

The SDK numbers a training client's requests 1, 2, 3, ... and sends the next
one as soon as the previous one is queued, so requests overlap in flight; a
chunked ``forward_backward`` even sends its first chunk last. The gate holds a
request until every lower ``seq_id`` of its model has been released, then
releases it (and any held successors) in order. Releasing only queues the work
(it must not block): the engine's per-run queue then keeps that order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from twinkle.errors import InvalidInputError

Action = Callable[[], None]


class SeqGate:
    """Per model: the next ``seq_id`` to release and the requests waiting for it."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._held: dict[str, dict[int, tuple[Action, Action]]] = {}  # model -> seq_id -> (release, cancel)
        self._lock = threading.Lock()

    def open(self, model_id: str, next_seq_id: int = 1) -> None:
        """Start ordering ``model_id``'s requests; the first one expected is ``next_seq_id``."""
        with self._lock:
            self._next[model_id] = next_seq_id
            self._held[model_id] = {}

    def close(self, model_id: str) -> None:
        """Stop ordering ``model_id``; the requests still held are cancelled."""
        with self._lock:
            self._next.pop(model_id, None)
            held = self._held.pop(model_id, {})
        for _, cancel in held.values():
            cancel()

    def submit(self, model_id: str, seq_id: int, release: Action, cancel: Action) -> None:
        """Release now if it is ``seq_id``'s turn (then any held successors), else hold it.

        ``seq_id`` 0 means "not set": such a request is not ordered. A ``seq_id``
        below the model's next one was already used (retries are deduplicated
        before they get here), which is the caller's error.
        """
        if seq_id == 0:
            release()
            return
        with self._lock:  # releases run under the lock too, so two submitters cannot reorder them
            expected = self._next.get(model_id)
            if expected is None:
                raise InvalidInputError(f"model {model_id!r} is not loaded; create or load it first")
            if seq_id < expected:
                raise InvalidInputError(
                    f"seq_id {seq_id} of model {model_id!r} was already used (the next one is {expected})"
                )
            held = self._held[model_id]
            if seq_id in held:
                raise InvalidInputError(f"seq_id {seq_id} of model {model_id!r} is already waiting for its turn")
            held[seq_id] = (release, cancel)
            while expected in held:
                self._next[model_id] = expected + 1
                held.pop(expected)[0]()
                expected += 1

    def waiting(self, model_id: str) -> list[int]:
        """The ``seq_id`` s held for ``model_id`` (for diagnostics)."""
        with self._lock:
            return sorted(self._held.get(model_id, {}))
