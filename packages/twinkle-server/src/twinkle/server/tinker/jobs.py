"""Turning a Tinker request into a future: deduplicated, ordered by ``seq_id``, run by the scheduler.

Every future-creating endpoint only enqueues (the SDK expects an answer within
its timeout); the work runs on the scheduler's worker thread, the only thread
that touches models, and its reply is stored as the bytes the SDK will read.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from twinkle.errors import InvalidInputError
from twinkle.server.app.state import ServerState
from twinkle.server.services.scheduler import Job
from twinkle.server.tinker.state import TinkerState

METHOD_PREFIX = "tinker."  # future methods of this API, so the native API can tell them apart


@dataclass(frozen=True)
class Caller:
    """One request's user and the server's state."""

    user: str
    state: ServerState
    tinker: TinkerState


def submit(
    caller: Caller,
    method: str,
    work: Callable[[], bytes],
    *,
    queue_key: str,
    run_id: str | None = None,
    seq_id: int | None = None,
    key: str | None = None,
    tokens: int = 0,
) -> str:
    """Queue ``work`` and return its future id (request id).

    With ``seq_id`` the request belongs to ``run_id``'s training stream: a retry of
    the same ``(run_id, seq_id)`` returns the first request's id without running
    again, and the work is released to the scheduler in ``seq_id`` order. Other
    requests are deduplicated on ``key`` when one is given.
    """
    state = caller.state
    if seq_id:
        key = f"tinker-seq:{seq_id}"
    future, created = state.futures.create(caller.user, METHOD_PREFIX + method, run_id, key)
    if not created:
        return future.id

    def on_done(result: bytes | None, error: BaseException | None) -> None:
        if error is not None:
            state.futures.fail(future.id, error)
        else:
            state.futures.resolve_raw(future.id, result or b"")

    def release() -> None:
        state.scheduler.submit(Job(queue_key, work, on_done, tokens=tokens, labels=(caller.user, method)))

    def cancel() -> None:
        state.futures.fail(future.id, RuntimeError("the model was unloaded before this request's turn came"))

    if run_id is None or not seq_id:
        release()
        return future.id
    try:
        caller.tinker.gate.submit(run_id, seq_id, release, cancel)
    except Exception as exc:
        state.futures.fail(future.id, exc)
        raise
    return future.id


def skip_turn(caller: Caller, run_id: str, seq_id: int | None) -> None:
    """A refused request still uses up its ``seq_id``, or every later request of the model would wait for it."""
    if seq_id:
        with suppress(InvalidInputError):  # the seq_id itself was the problem: nothing to skip
            caller.tinker.gate.submit(run_id, seq_id, lambda: None, lambda: None)
