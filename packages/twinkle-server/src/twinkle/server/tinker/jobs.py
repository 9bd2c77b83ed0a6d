"""Turning a Tinker request into a future: deduplicated, ordered by ``seq_id``, run by the engine.

Every future-creating endpoint only enqueues (the SDK expects an answer within
its timeout). The work is a task (data, see ``services/engine.py``) run by the
pool holding the run, in this process or on a Ray replica; ``finish`` then turns
its result into the bytes the SDK will read, here, where the store and the
Tinker state are.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.model import TargetsRequest
from twinkle.server.app.state import ServerState
from twinkle.server.services.engine import PoolTask, Task
from twinkle.server.services.futures import api_method
from twinkle.server.tinker.state import TinkerState
from twinkle.utils import get_logger

logger = get_logger(__name__)

API = "tinker"  # this API's futures are stored as api_method(API, method), so the native API can tell them apart


@dataclass(frozen=True)
class Caller:
    """One request's user and the server's state."""

    user: str
    state: ServerState
    tinker: TinkerState


def submit(
    caller: Caller,
    method: str,
    task: Task,
    *,
    queue_key: str,
    run_id: str | None = None,
    seq_id: int | None = None,
    key: str | None = None,
    tokens: int = 0,
    shared: TargetsRequest | None = None,
    replica: int | None = None,
    finish: Callable[[Any], bytes] | None = None,
    on_failure: Callable[[], None] | None = None,
    settled: Callable[[], None] | None = None,
) -> str:
    """Queue ``task`` (on ``replica``, by default the one ``queue_key`` routes to) and return its future id.

    With ``seq_id`` the request belongs to ``run_id``'s training stream: a retry of
    the same ``(run_id, seq_id)`` returns the first request's id without running
    again, and the work is released to the engine in ``seq_id`` order. Other
    requests are deduplicated on ``key`` when one is given. With ``shared`` the call may join other tenants'
    calls in a shared pass. ``finish`` makes the reply
    from the task's result (default: the result is the reply); ``on_failure`` runs if either fails.
    ``settled`` runs once this request is over however it ends (done, failed, cancelled, refused
    here, or a retry of a request already made), e.g. to let go of the checkpoint it reads.
    """
    state = caller.state
    done = settled or (lambda: None)
    if seq_id:
        key = f"tinker-seq:{seq_id}"
    try:
        future, created = state.futures.create(caller.user, api_method(API, method), run_id, key)
    except BaseException:
        done()
        raise
    if not created:
        done()
        return future.id

    def on_done(result: Any, error: BaseException | None) -> None:
        if error is None and finish is not None:
            try:
                result = finish(result)
            except Exception as exc:  # recording the result failed: the caller must hear about it
                error = exc
        done()
        if error is not None:
            if on_failure is not None:
                on_failure()
            state.futures.fail(future.id, error)
        else:
            state.futures.resolve_raw(future.id, result or b"")

    def release() -> None:
        labels = (caller.user, api_method(API, method))
        state.engine.submit(queue_key, task, on_done, shared, tokens, labels, replica)

    def cancel() -> None:
        done()
        state.futures.fail(future.id, RuntimeError("the model was unloaded before this request's turn came"))

    try:
        if run_id is None or not seq_id:
            release()
        else:
            caller.tinker.gate.submit(run_id, seq_id, release, cancel)
    except Exception as exc:
        done()
        state.futures.fail(future.id, exc)
        raise
    return future.id


def skip_turn(caller: Caller, run_id: str, seq_id: int | None) -> None:
    """A refused request still uses up its ``seq_id``, or every later request of the model would wait for it."""
    if seq_id:
        with suppress(InvalidInputError):  # the seq_id itself was the problem: nothing to skip
            caller.tinker.gate.submit(run_id, seq_id, lambda: None, lambda: None)


def drop_sampler_adapters(
    state: ServerState, user: str, run_id: str, adapters: list[str], replica: int | None = None
) -> None:
    """Queue the removal of sampler adapters from the pool that holds (or held) ``run_id``, or from ``replica``'s;
    no one waits for it."""

    def on_done(_: Any, error: BaseException | None) -> None:
        if error is not None:
            logger.warning("could not drop sampler adapters %s of %s: %s", adapters, run_id, error)

    for adapter in adapters:
        task = PoolTask("drop_sampler_adapter", (adapter,))
        labels = (user, api_method(API, "drop_sampler_adapter"))
        state.engine.submit(run_id, task, on_done, None, 0, labels, replica)
