"""Training clients: create (fresh or from a checkpoint), forward/backward, optimizer steps, saves, futures."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import JsonValue
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from twinkle.errors import InvalidInputError
from twinkle.server.contract import request_body
from twinkle.server.services.engine import FunctionTask
from twinkle.server.services.futures import api_of
from twinkle.server.services.runs import record_run
from twinkle.server.store import check_ttl_seconds
from twinkle.server.tinker import checkpoints, training
from twinkle.server.tinker.codec import decode_forward_backward
from twinkle.server.tinker.http import (
    PREFIX,
    TinkerRoute,
    check_base_model,
    future,
    reply,
    resident_run,
    tinker_caller,
)
from twinkle.server.tinker.images import image_sizes
from twinkle.server.tinker.jobs import API, Caller, skip_turn, submit
from twinkle.server.tinker.paths import CheckpointPath, training_run_id
from twinkle.server.tinker.replies import POLL_WAIT_S, PROTO_MEDIA_TYPE, future_reply
from twinkle.server.tinker.routes_sampling import submit_snapshot

router = APIRouter(prefix=PREFIX, route_class=TinkerRoute, tags=["tinker"])


def _new_run(
    caller: Caller,
    session_id: str,
    model_seq_id: int,
    config: dict[str, Any],
    metadata: dict[str, Any],
    then: FunctionTask | None,
    settled: Callable[[], None] | None = None,
) -> JSONResponse:
    """Record and load a new model (its first request, seq 0); ``then`` (a load) runs right after and replies.

    ``settled`` runs once the request is over, however it ends (see :func:`submit`).
    """
    state, user = caller.state, caller.user
    run_id = training_run_id(session_id, model_seq_id)
    existing = state.store.get_run(user, run_id)
    if existing is None:
        record_run(state.store, state.quotas, user, session_id, config, run_id=run_id, metadata=metadata)
        caller.tinker.gate.open(run_id)
        state.engine.place(user, run_id)  # its requests all go to one replica from this first one on

    def failed() -> None:
        state.store.set_resident(user, run_id, False)
        state.engine.unplace(run_id)

    task = FunctionTask(training.create_model, (run_id, config, metadata.get("seed"), then))
    request_id = submit(
        caller,
        "create_model",
        task,
        queue_key=run_id,
        run_id=run_id,
        key="tinker-create",
        on_failure=failed,
        settled=settled,
    )
    return future(request_id, model_id=run_id)


@router.post("/create_model", response_model=types.UntypedAPIFuture)
async def create_model(
    request: Request, body: Annotated[types.CreateModelRequest, request_body(types.CreateModelRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)
    check_base_model(caller, body.base_model)
    if body.optimizer_config.type != "adamw":
        raise InvalidInputError(f"optimizer {body.optimizer_config.type!r} is not supported; this server uses AdamW")
    lora = body.lora_config
    if lora is None:
        raise InvalidInputError("this server trains LoRA adapters: pass lora_config (create_lora_training_client)")
    config = training.lora_config(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
    metadata = {
        "api": "tinker",
        "base_model": body.base_model,
        "user_metadata": body.user_metadata or {},
        "lora_rank": lora.rank,
        "seed": lora.seed,
    }
    return _new_run(caller, body.session_id, body.model_seq_id, config, metadata, then=None)


@router.post("/get_info", response_model=types.GetInfoResponse)
async def get_info(
    request: Request, body: Annotated[types.GetInfoRequest, request_body(types.GetInfoRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)
    run = resident_run(caller, body.model_id)
    engine, base_model = caller.state.engine, run.metadata.get("base_model") or caller.state.config.model_id
    rank = int((run.lora_config or {}).get("r", 0))
    return reply(
        {
            "model_id": run.id,
            "is_lora": True,
            "lora_rank": rank,
            "model_name": base_model,
            "type": "get_info",
            "model_data": {"arch": engine.model_type, "model_name": base_model, "tokenizer_id": engine.model_path},
        }
    )


FORWARD_BACKWARD_BODY = {
    "requestBody": {
        "required": True,
        "description": "The SDK's ForwardBackwardRequest protobuf (tinker.proto), zstd-compressed when "
        "Content-Encoding says so",
        "content": {PROTO_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post("/forward_backward", response_model=types.UntypedAPIFuture, openapi_extra=FORWARD_BACKWARD_BODY)
async def forward_backward(request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    call = decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
    resident_run(caller, call.model_id)
    state = caller.state
    try:
        images = [image for datum in call.data for image in datum.images]
        state.quotas.check_images(caller.user, image_sizes(images), "forward_backward")
        # It may join other tenants' passes; its images become vision tokens and pixel values here.
        shared = training.checked_request(state.engine, call, state.config.model_id)
        tokens = sum(len(datum.tokens) for datum in call.data)
        caller.state.quotas.check_tokens(caller.user, tokens)
    except Exception:
        skip_turn(caller, call.model_id, call.seq_id)
        raise
    task = FunctionTask(training.forward_backward, (shared,))
    method = "forward" if call.forward_only else "forward_backward"
    request_id = submit(
        caller,
        method,
        task,
        queue_key=call.model_id,
        run_id=call.model_id,
        seq_id=call.seq_id,
        tokens=tokens,
        shared=shared,
        finish=training.encode_output,
    )
    return future(request_id, model_id=call.model_id)


@router.post("/optim_step", response_model=types.UntypedAPIFuture)
async def optim_step(
    request: Request, body: Annotated[types.OptimStepRequest, request_body(types.OptimStepRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)
    resident_run(caller, body.model_id)
    try:
        params = _adam_params(body.optim_params)
    except Exception:
        skip_turn(caller, body.model_id, body.seq_id)
        raise
    task = FunctionTask(training.optim_step, (body.model_id, params))
    request_id = submit(caller, "optim_step", task, queue_key=body.model_id, run_id=body.model_id, seq_id=body.seq_id)
    return future(request_id, model_id=body.model_id)


@router.post("/save_weights", response_model=types.UntypedAPIFuture)
async def save_weights(
    request: Request, body: Annotated[types.SaveWeightsRequest, request_body(types.SaveWeightsRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)
    resident_run(caller, body.model_id)
    target = CheckpointPath(body.model_id, "training", str(body.path))
    return _save(caller, target, body.seq_id, bool(body.overwrite), body.ttl_seconds)


@router.post("/save_weights_for_sampler", response_model=types.UntypedAPIFuture)
async def save_weights_for_sampler(
    request: Request,
    body: Annotated[types.SaveWeightsForSamplerRequest, request_body(types.SaveWeightsForSamplerRequest)],
) -> JSONResponse:
    caller = tinker_caller(request)
    run = resident_run(caller, body.model_id)
    if body.path is not None:
        target = CheckpointPath(run.id, "sampler", body.path)
        return _save(caller, target, body.seq_id, overwrite=True, ttl_seconds=body.ttl_seconds)
    if body.sampling_session_seq_id is None:
        skip_turn(caller, run.id, body.seq_id)
        raise InvalidInputError("save_weights_for_sampler needs a path (a name) or a sampling_session_seq_id")
    request_id = submit_snapshot(caller, run, body.sampling_session_seq_id, body.kind, body.seq_id)
    return future(request_id, model_id=run.id)


def _save(
    caller: Caller, target: CheckpointPath, seq_id: int | None, overwrite: bool, ttl_seconds: int | None
) -> JSONResponse:
    try:
        ttl = check_ttl_seconds(ttl_seconds)
        checkpoints.check_new_checkpoint(caller, target, overwrite)
    except Exception:
        skip_turn(caller, target.run_id, seq_id)
        raise
    method = "save_weights" if target.kind == "training" else "save_weights_for_sampler"
    hold = caller.state.checkpoints.hold_for_save(caller.user, target.run_id, target.store_name)
    finish = lambda path: checkpoints.record(caller, target, path, ttl)  # noqa: E731
    task = FunctionTask(checkpoints.write, (target.run_id, hold.path, target.kind == "training"))
    request_id = submit(
        caller,
        method,
        task,
        queue_key=target.run_id,
        run_id=target.run_id,
        seq_id=seq_id,
        finish=finish,
        settled=hold.release,
    )
    return future(request_id, model_id=target.run_id)


@router.post("/load_weights", response_model=types.UntypedAPIFuture)
async def load_weights(
    request: Request, body: Annotated[types.LoadWeightsRequest, request_body(types.LoadWeightsRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)
    if body.session_id is not None:  # create a model from a checkpoint (the SDK names it itself)
        if body.model_seq_id is None:
            raise InvalidInputError("load_weights with session_id needs model_seq_id")
        check_base_model(caller, body.base_model)
        target, hold = checkpoints.hold(caller, body.path)  # its files stay until the load is over
        try:
            config = checkpoints.source_lora_config(caller, target)
            source = caller.state.store.get_run(caller.user, target.run_id)
            source_metadata = source.metadata if source is not None else {}  # the run may be gone by now
            metadata = {
                "api": "tinker",
                "base_model": body.base_model or source_metadata.get("base_model"),
                "user_metadata": body.user_metadata or {},
                "lora_rank": config.get("r"),
                "loaded_from": target.tinker_path,
            }
            run_id = training_run_id(body.session_id, body.model_seq_id)
            then = FunctionTask(checkpoints.load, (run_id, hold.path, body.optimizer))
            return _new_run(caller, body.session_id, body.model_seq_id, config, metadata, then, hold.release)
        except BaseException:
            hold.release()
            raise
    if body.model_id is None:
        raise InvalidInputError("load_weights needs model_id (and seq_id), or session_id and model_seq_id")
    run = resident_run(caller, body.model_id)
    try:
        _, hold = checkpoints.hold(caller, body.path)
    except Exception:
        skip_turn(caller, run.id, body.seq_id)
        raise
    task = FunctionTask(checkpoints.load, (run.id, hold.path, body.optimizer))
    request_id = submit(
        caller, "load_weights", task, queue_key=run.id, run_id=run.id, seq_id=body.seq_id, settled=hold.release
    )
    return future(request_id, model_id=run.id)


RETRIEVED_PROTO: dict[int | str, dict[str, Any]] = {
    200: {"content": {PROTO_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}
}
# What a future holds once retrieved, in JSON; forward/backward results come as the SDK's protobuf instead,
# and sampling results as the JSON its (non-pydantic) SampleResponse reads.
RetrievedFuture = (
    TryAgainResponse
    | types.RequestFailedResponse
    | types.OptimStepResponse
    | types.SaveWeightsResponse
    | types.SaveWeightsForSamplerResponse
    | types.LoadWeightsResponse
    | types.CreateModelResponse
    | dict[str, JsonValue]
)


@router.post(
    "/retrieve_future",
    response_model=RetrievedFuture,
    responses=RETRIEVED_PROTO,  # forward/backward results come as the SDK's protobuf
)
async def retrieve_future(
    request: Request, body: Annotated[types.FutureRetrieveRequest, request_body(types.FutureRetrieveRequest)]
) -> Response:
    caller = tinker_caller(request)
    found = await caller.state.futures.wait(caller.user, body.request_id, POLL_WAIT_S)
    if api_of(found.method) != API:
        raise InvalidInputError(f"{body.request_id!r} is a native Twinkle future; poll it at /twinkle/v1/futures")
    return future_reply(found)


def _adam_params(params: object) -> dict[str, float]:
    if not isinstance(params, types.AdamParams):
        name = getattr(params, "type", params)
        raise InvalidInputError(f"optimizer {name!r} is not supported; this server uses AdamW")
    values = params.model_dump()
    if not all(math.isfinite(value) for value in values.values()):
        raise InvalidInputError(f"AdamParams must be finite numbers, got {values}")
    if min(values["learning_rate"], values["weight_decay"], values["grad_clip_norm"]) < 0 or values["eps"] <= 0:
        raise InvalidInputError(
            f"AdamParams: learning_rate, weight_decay and grad_clip_norm must be >= 0 and eps > 0, got {values}"
        )
    if not (0 <= values["beta1"] < 1 and 0 <= values["beta2"] < 1):
        raise InvalidInputError(f"AdamParams: beta1 and beta2 must be in [0, 1), got {values}")
    return values
