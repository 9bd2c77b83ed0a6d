"""Submitting a long call as a future: the one implementation under both APIs.

A call becomes a future in the store (a repeated key returns the first call's
future, which runs once), then a task on the engine, queued under its run; when
the task is done its result is encoded and stored, or its error recorded. The
native routes (``app/calls.py``) and the Tinker routes (``tinker/jobs.py``)
only decide what the call is, how its result is encoded, and (Tinker) the
``seq_id`` order in which it is released to the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twinkle.server.services.batches import SharedRequest
from twinkle.server.services.engine import Engine, Labels, Task
from twinkle.server.services.futures import Futures

Action = Callable[[], None]
# Releases the call to the engine, now or once its turn comes (``release``), or drops it (``cancel``).
Gate = Callable[[Action, Action], None]


@dataclass(frozen=True)
class Submission:
    """One long call: its future (``method`` as stored, ``key`` to deduplicate) and its engine task."""

    user: str
    method: str
    run_id: str | None
    key: str | None
    task: Task
    queue_key: str
    labels: Labels
    encode: Callable[[Any], bytes]  # the task's result -> the stored reply
    shared: SharedRequest | None = None  # set when the call may join other tenants' (a shared pass, sampled together)
    tokens: int = 0
    replica: int | None = None


def submit(
    futures: Futures,
    engine: Engine,
    call: Submission,
    settled: Action | None = None,
    on_failure: Action | None = None,
    gate: Gate | None = None,
) -> str:
    """Create the call's future and queue its task; returns the future id.

    ``settled`` runs once the call is over however it ends (done, failed,
    cancelled, refused here, or a repeat of a call already made), e.g. to let go
    of the checkpoint it reads; ``on_failure`` runs if the task or its encoding
    fails. ``gate`` decides when the task reaches the engine (default: now).
    """
    done = settled or (lambda: None)
    try:
        future, created = futures.create(call.user, call.method, call.run_id, call.key)
    except BaseException:
        done()
        raise
    if not created:
        done()
        return future.id

    def on_done(result: Any, error: BaseException | None) -> None:
        payload = b""
        if error is None:
            try:
                payload = call.encode(result)
            except Exception as exc:  # recording the result failed: the caller must hear about it
                error = exc
        done()
        if error is not None:
            if on_failure is not None:
                on_failure()
            futures.fail(future.id, error)
        else:
            futures.resolve_raw(future.id, payload)

    def release() -> None:
        engine.submit(call.queue_key, call.task, on_done, call.shared, call.tokens, call.labels, call.replica)

    def cancel() -> None:
        done()
        futures.fail(future.id, RuntimeError("the model was unloaded before this request's turn came"))

    try:
        (gate or (lambda go, _: go()))(release, cancel)
    except Exception as exc:
        done()
        futures.fail(future.id, exc)
        raise
    return future.id
