"""Running a tenant's in-process API call on its run: checks, the job, and what the result becomes.

Short calls (``set_*``, ``update_optimizer``, ``zero_grad``, ``lr_step``, ``calculate_metric``) are
answered directly; long ones get a future. Every call goes through the
scheduler on the run's own queue, so a tenant's calls run in order and never
overlap a shared pass.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from twinkle.data_format import validate_input_feature
from twinkle.errors import ConfigurationError, InvalidInputError, ResourceNotFoundError
from twinkle.model import AdapterRequest
from twinkle.model.microbatch import check_loss_inputs
from twinkle.server.app.state import ServerState
from twinkle.server.paths import SAMPLER_WEIGHTS_DIR, safe_child
from twinkle.server.services.components import check_call_components
from twinkle.server.services.convert import to_wire
from twinkle.server.services.engine import PoolTask
from twinkle.server.services.pool import LONG_METHODS, SHORT_METHODS
from twinkle.server.services.scheduler import SHARED_METHOD

CHECKPOINT_SCHEME = "twinkle://"
SHORT_CALL_TIMEOUT_S = 600.0


def run_short_call(state: ServerState, user: str, run_id: str, method: str, kwargs: dict[str, Any]) -> Any:
    check_call_components(method, kwargs)
    result = state.engine.call(run_id, PoolTask("call", (run_id, method, kwargs)), SHORT_CALL_TIMEOUT_S, (user, method))
    return to_wire(result)


def submit_long_call(
    state: ServerState, user: str, run_id: str, method: str, kwargs: dict[str, Any], idempotency_key: str | None
) -> str:
    """Queue the call and return its future id (the first call's, when the idempotency key repeats)."""
    finish = _prepare(state, user, run_id, method, kwargs)
    check_features(state, kwargs.get("inputs"))  # a bad batch is the caller's 400 now, not a failed future later
    if method == SHARED_METHOD:
        check_loss_input_lengths(kwargs)
    tokens = count_tokens(kwargs.get("inputs"))
    state.quotas.check_tokens(user, tokens)  # before the future exists: a refused call must leave none behind
    future, created = state.futures.create(user, method, run_id, idempotency_key)
    if not created:
        return future.id

    def on_done(result: Any, error: BaseException | None) -> None:
        if error is not None:
            state.futures.fail(future.id, error)
            return
        try:
            state.futures.resolve(future.id, to_wire(finish(result)))
        except Exception as exc:  # recording the result failed: the caller must hear about it
            state.futures.fail(future.id, exc)

    shared = None
    # micro_batch_size=None (the default, which the client spells out) must not keep a call out of a pass
    shareable = not state.engine.is_private(run_id) and kwargs.get("micro_batch_size") is None and "inputs" in kwargs
    if method == SHARED_METHOD and shareable:
        loss_inputs = {key: value for key, value in kwargs.items() if key not in ("inputs", "micro_batch_size")}
        shared = AdapterRequest(run_id, kwargs["inputs"], loss_inputs)
    state.engine.submit(run_id, PoolTask("call", (run_id, method, kwargs)), on_done, shared, tokens, (user, method))
    return future.id


def check_method(method: Any) -> str:
    if method not in SHORT_METHODS | LONG_METHODS:
        raise InvalidInputError(f"unknown method {method!r}; callable: {sorted(SHORT_METHODS | LONG_METHODS)}")
    return method


def check_features(state: ServerState, inputs: Any) -> None:
    """Types, token ids and lengths of encoded features (trajectories are checked once encoded, in the job)."""
    items = [inputs] if isinstance(inputs, Mapping) else inputs
    if not isinstance(items, list):
        return
    limit = state.engine.max_length
    for index, item in enumerate(items):
        if isinstance(item, Mapping) and "input_ids" in item:
            feature = validate_input_feature(item, where=f"inputs[{index}]", vocab_size=state.engine.vocab_size)
            if len(feature["input_ids"]) > limit:
                raise InvalidInputError(
                    f"inputs[{index}] has {len(feature['input_ids'])} tokens; the model's context is {limit}"
                )


def check_loss_input_lengths(kwargs: Mapping[str, Any]) -> None:
    """``forward_backward``'s per-sample loss inputs (``advantages``, ...) need one entry per sample of ``inputs``."""
    inputs = kwargs.get("inputs")
    items = [inputs] if isinstance(inputs, Mapping) else inputs
    if isinstance(items, list):
        loss_inputs = {key: value for key, value in kwargs.items() if key not in ("inputs", "micro_batch_size")}
        check_loss_inputs(loss_inputs, len(items))


def count_tokens(inputs: Any) -> int:
    """Tokens in a batch of features (trajectories are encoded on the server, so they count once encoded)."""
    if isinstance(inputs, Mapping):
        inputs = [inputs]
    if not isinstance(inputs, list):
        return 0
    return sum(len(item["input_ids"]) for item in inputs if isinstance(item, Mapping) and "input_ids" in item)


def checkpoint_reference(run_id: str, name: str) -> str:
    return f"{CHECKPOINT_SCHEME}{run_id}/{name}"


def delete_checkpoint(state: ServerState, user: str, run_id: str, name: str, shown: str | None = None) -> None:
    """Forget checkpoint ``name`` of the run and remove its files; ``shown`` names it in the error (Tinker paths)."""
    if state.store.get_checkpoint(user, run_id, name) is None:
        raise ResourceNotFoundError(
            f"no checkpoint {shown!r}" if shown else f"run {run_id!r} has no checkpoint {name!r}"
        )
    path = checkpoint_directory(state, user, run_id, name)
    state.store.delete_checkpoint(user, run_id, name)
    shutil.rmtree(path, ignore_errors=True)


def checkpoint_directory(state: ServerState, user: str, run_id: str, name: str) -> Path:
    """Where checkpoint ``name`` of the run lives (Tinker's sampler weights are ``sampler_weights/<name>``)."""
    return safe_child(state.config.checkpoint_dir, user, run_id, *name.split("/"))


def _prepare(state: ServerState, user: str, run_id: str, method: str, kwargs: dict[str, Any]) -> Any:
    """Rewrite server-side paths in ``kwargs``; returns how to turn the method's result into the reply."""
    for forbidden in ("output_dir", "dataloader"):
        if forbidden in kwargs:
            raise InvalidInputError(f"{method}: {forbidden!r} cannot be set remotely; the server decides it")
    if method == "save":
        name = kwargs.get("name")
        if not isinstance(name, str):
            raise InvalidInputError(f"save needs a checkpoint name (a string), got {name!r}")
        safe_child(state.config.checkpoint_dir, user, run_id, name)  # refuses traversal before anything runs
        if name == SAMPLER_WEIGHTS_DIR:
            raise InvalidInputError(f"the checkpoint name {name!r} is reserved for sampler weights saved over Tinker")
        kwargs["output_dir"] = str(safe_child(state.config.checkpoint_dir, user, run_id))

        def record(path: Any) -> str:
            state.store.add_checkpoint(user, run_id, name, str(path))
            return checkpoint_reference(run_id, name)

        return record
    if method == "load":
        kwargs["path"] = resolve_checkpoint(state, user, run_id, kwargs.get("path"))
    return lambda result: result


def resolve_checkpoint(state: ServerState, user: str, run_id: str, reference: Any) -> str:
    """``twinkle://<run>/<name>`` (any run of the same user) or a bare checkpoint name of this run."""
    if not isinstance(reference, str) or not reference:
        raise InvalidInputError(f"load needs path='{CHECKPOINT_SCHEME}<run_id>/<name>' or a checkpoint name")
    source_run, name = run_id, reference
    if reference.startswith(CHECKPOINT_SCHEME):
        source_run, _, name = reference.removeprefix(CHECKPOINT_SCHEME).partition("/")
    return checkpoint_path(state, user, source_run, name, shown=reference)


def checkpoint_path(state: ServerState, user: str, run_id: str, name: str, shown: str) -> str:
    """The saved folder of checkpoint ``name`` of the user's run; ``shown`` is how errors name it."""
    checkpoint = state.store.get_checkpoint(user, run_id, name)
    if checkpoint is None:
        raise ResourceNotFoundError(f"no checkpoint {shown!r}")
    if not checkpoint_directory(state, user, run_id, name).is_dir():
        raise ConfigurationError(f"checkpoint {shown!r} is recorded but its files are gone")
    return checkpoint.path
