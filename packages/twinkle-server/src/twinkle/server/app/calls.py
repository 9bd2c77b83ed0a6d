"""Running a tenant's in-process API call on its run: the job, and what the result becomes.

Arguments arrive validated (``schemas.calls``); what is left here is what depends on the server's state:
quotas, checkpoint paths, and whether the call can join a shared pass.

Short calls (``set_*``, ``update_optimizer``, ``zero_grad``, ``lr_step``, ``calculate_metric``) are
answered directly; long ones get a future. Every call goes through the
scheduler on the run's own queue, so a tenant's calls run in order and never
overlap a shared pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twinkle import wire
from twinkle.errors import InvalidInputError
from twinkle.model import AdapterRequest
from twinkle.server.app.state import ServerState
from twinkle.server.images import check_native_images
from twinkle.server.paths import safe_child
from twinkle.server.services import submissions
from twinkle.server.services.checkpoints import CheckpointHold
from twinkle.server.services.convert import to_wire
from twinkle.server.services.engine import PoolTask
from twinkle.server.services.submissions import Submission
from twinkle.server.store import Checkpoint

CHECKPOINT_SCHEME = "twinkle://"
SHORT_CALL_TIMEOUT_S = 600.0


def run_short_call(state: ServerState, user: str, run_id: str, method: str, kwargs: dict[str, Any]) -> Any:
    result = state.engine.call(run_id, PoolTask("call", (run_id, method, kwargs)), SHORT_CALL_TIMEOUT_S, (user, method))
    return to_wire(result)


def submit_long_call(
    state: ServerState, user: str, run_id: str, method: str, kwargs: dict[str, Any], idempotency_key: str | None
) -> str:
    """Queue the call and return its future id (the first call's, when the idempotency key repeats)."""
    finish, hold = _prepare(state, user, run_id, method, kwargs)
    try:
        return _submit(state, user, run_id, method, kwargs, idempotency_key, finish, hold)
    except BaseException:
        _release(hold)
        raise


def _submit(
    state: ServerState,
    user: str,
    run_id: str,
    method: str,
    kwargs: dict[str, Any],
    idempotency_key: str | None,
    finish: Callable[[Any], Any],
    hold: CheckpointHold | None,
) -> str:
    tokens = count_tokens(kwargs.get("inputs"))
    state.quotas.check_tokens(user, tokens)  # before the future exists: a refused call must leave none behind
    check_inputs_images(state, user, kwargs.get("inputs"))  # a bad image must not fail a shared pass
    shared = None if state.engine.is_private(run_id) else shared_request(run_id, method, kwargs)
    call = Submission(
        user,
        method,
        run_id,
        idempotency_key,
        PoolTask("call", (run_id, method, kwargs)),
        queue_key=run_id,
        labels=(user, method),
        encode=lambda result: wire.encode(to_wire(finish(result))),
        shared=shared,
        tokens=tokens,
    )
    return submissions.submit(state.futures, state.engine, call, settled=None if hold is None else hold.release)


def shared_request(run_id: str, method: str, kwargs: Mapping[str, Any]) -> AdapterRequest | None:
    """The request with which a ``forward_backward`` or ``forward_only`` call joins other runs' shared passes;
    None for a call that runs alone (another method, its own micro-batches, or full logits asked for)."""
    # micro_batch_size=None and return_logits=False (the defaults, which the client spells out) keep nothing out
    if "inputs" not in kwargs or kwargs.get("micro_batch_size") is not None or kwargs.get("return_logits"):
        return None
    own = ("inputs", "micro_batch_size", "return_logits")
    loss_inputs = {key: value for key, value in kwargs.items() if key not in own}
    if method == "forward_backward":
        return AdapterRequest(run_id, kwargs["inputs"], loss_inputs)
    if method == "forward_only":
        return AdapterRequest(run_id, kwargs["inputs"], loss_inputs, backward=False)
    return None


def check_inputs_images(state: ServerState, user: str, inputs: Any, where: str = "inputs") -> None:
    """Refuse a request whose images are not sent by value, exceed the user's quotas, do not decode, do not
    match their placeholders, or go to a text-only model (:mod:`twinkle.server.images`)."""
    check_native_images(state.quotas, user, state.engine.model_path, state.config.model_id, inputs, where)


def count_tokens(inputs: Any) -> int:
    """Tokens in a batch of features (trajectories are encoded on the server, so they count once encoded)."""
    if isinstance(inputs, Mapping):
        inputs = [inputs]
    if not isinstance(inputs, list):
        return 0
    return sum(len(item["input_ids"]) for item in inputs if isinstance(item, Mapping) and "input_ids" in item)


def checkpoint_reference(run_id: str, name: str) -> str:
    return f"{CHECKPOINT_SCHEME}{run_id}/{name}"


def _prepare(
    state: ServerState, user: str, run_id: str, method: str, kwargs: dict[str, Any]
) -> tuple[Callable[[Any], Any], CheckpointHold | None]:
    """Rewrite server-side paths in ``kwargs``; returns how to turn the method's result into the reply, and the
    checkpoint the call reads or writes (held until the call is over)."""
    if method == "save":
        name = kwargs["name"]
        ttl_seconds = kwargs.pop("ttl_seconds")  # the server's option, not the model's
        kwargs["output_dir"] = str(safe_child(state.config.checkpoint_dir, user, run_id))

        def record(path: Any) -> str:
            state.checkpoints.record(user, run_id, name, str(path), ttl_seconds)
            return checkpoint_reference(run_id, name)

        return record, state.checkpoints.hold_for_save(user, run_id, name)
    if method == "load":
        hold = hold_checkpoint(state, user, run_id, kwargs.get("path"))
        kwargs["path"] = str(hold.path)
        return (lambda result: result), hold
    return (lambda result: result), None


def _release(hold: CheckpointHold | None) -> None:
    if hold is not None:
        hold.release()


def _parse_reference(run_id: str, reference: Any) -> tuple[str, str]:
    """``(run, name)`` of ``twinkle://<run>/<name>`` (any run of the same user) or a bare name of this run."""
    if not isinstance(reference, str) or not reference:
        raise InvalidInputError(f"load needs path='{CHECKPOINT_SCHEME}<run_id>/<name>' or a checkpoint name")
    if reference.startswith(CHECKPOINT_SCHEME):
        source_run, _, name = reference.removeprefix(CHECKPOINT_SCHEME).partition("/")
        return source_run, name
    return run_id, reference


def resolve_checkpoint(state: ServerState, user: str, run_id: str, reference: Any) -> Checkpoint:
    """The user's live checkpoint that ``reference`` names (404 if there is none)."""
    return state.checkpoints.existing(user, *_parse_reference(run_id, reference), shown=reference)


def hold_checkpoint(state: ServerState, user: str, run_id: str, reference: Any) -> CheckpointHold:
    """:func:`resolve_checkpoint`, its files kept until the hold is released (the task reading them is over)."""
    return state.checkpoints.hold(user, *_parse_reference(run_id, reference), shown=reference)
