"""Turning a Tinker request into a future: deduplicated, ordered by ``seq_id``, run by the engine.

The future and its task are made by ``services/submissions.py``, as for native calls; this module adds
Tinker's keys, its ``seq_id`` gate and its stored method names.

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
from functools import partial
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.server.app.state import ServerState
from twinkle.server.services import submissions
from twinkle.server.services.batches import SharedRequest
from twinkle.server.services.engine import PoolTask, Task
from twinkle.server.services.futures import api_method
from twinkle.server.services.submissions import Submission
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
    shared: SharedRequest | None = None,
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
    calls (a shared pass, or sample calls generated together). ``finish`` makes the reply from the task's
    result (default: the result is the reply); ``on_failure`` runs if either fails.
    ``settled`` runs once this request is over however it ends (done, failed, cancelled, refused
    here, or a retry of a request already made), e.g. to let go of the checkpoint it reads.
    """
    if seq_id:
        key = f"tinker-seq:{seq_id}"
    gate = partial(caller.tinker.gate.submit, run_id, seq_id) if run_id is not None and seq_id else None
    stored = api_method(API, method)
    call = Submission(
        caller.user,
        stored,
        run_id,
        key,
        task,
        queue_key=queue_key,
        labels=(caller.user, stored),
        encode=finish or (lambda result: result or b""),
        shared=shared,
        tokens=tokens,
        replica=replica,
    )
    return submissions.submit(caller.state.futures, caller.state.engine, call, settled, on_failure, gate)


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
