"""Health, metrics, server info, sessions, futures, sampling and server-side data."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from twinkle import wire
from twinkle.data_format import SamplingParams
from twinkle.errors import InvalidInputError, PermissionDeniedError, ResourceNotFoundError
from twinkle.server.app.calls import check_inputs_images, count_tokens, hold_checkpoint
from twinkle.server.app.http import caller, reply
from twinkle.server.app.routes_runs import owned_run, server
from twinkle.server.app.routing import NativeRoute
from twinkle.server.app.schemas.common import Empty, FutureCreated, spec_dict
from twinkle.server.app.schemas.misc import (
    CreateDataloader,
    CreateDataset,
    DataHandle,
    Decode,
    Encode,
    Features,
    FutureReply,
    Health,
    NextBatch,
    Replicas,
    Sample,
    ServerInfo,
    SessionCreated,
    Texts,
)
from twinkle.server.contract import request_body
from twinkle.server.services.batches import SampleRequest, sample_slots
from twinkle.server.services.convert import from_wire, to_wire
from twinkle.server.services.engine import PoolTask
from twinkle.server.services.futures import api_of

router = APIRouter(route_class=NativeRoute)
api = APIRouter(prefix="/twinkle/v1", route_class=NativeRoute)
VERSION = "0.1.0"
LOOPBACK = "127.0.0.1"


@router.get("/healthz", response_model=Health)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/metrics", response_class=Response, responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}
)
async def metrics(request: Request) -> Response:
    content, media_type = server(request).telemetry.render()
    return Response(content, media_type=media_type)


@router.get("/admin/replicas", response_model=Replicas)
async def replicas(request: Request) -> Response:
    """Where runs execute (pids, runs, adapters): for the operator on this machine only, so no API key."""
    if request.client is None or request.client.host != LOOPBACK:
        raise PermissionDeniedError("/admin/replicas answers requests from 127.0.0.1 only")
    return reply(request, {"replicas": await run_in_threadpool(server(request).engine.replicas)})


@api.get("/server_info", response_model=ServerInfo)
async def server_info(request: Request) -> Response:
    caller(request)
    state = server(request)
    return reply(
        request,
        {
            "base_model": state.config.model_id,
            "max_rank": state.engine.max_rank,
            "max_loras": state.engine.max_loras,
            "version": VERSION,
        },
    )


@api.post("/sessions", response_model=SessionCreated)
async def create_session(request: Request, _: Annotated[Empty, request_body(Empty)]) -> Response:
    user = caller(request)
    return reply(request, {"session_id": server(request).store.create_session(user).id})


@api.post("/sessions/{session_id}/heartbeat", response_model=Empty)
async def heartbeat(session_id: str, request: Request, _: Annotated[Empty, request_body(Empty)]) -> Response:
    user = caller(request)
    if not server(request).store.heartbeat(user, session_id):
        raise ResourceNotFoundError(f"no open session {session_id!r} (it may have expired: create a new one)")
    return reply(request, {})


@api.delete("/sessions/{session_id}", response_model=Empty)
async def close_session(session_id: str, request: Request) -> Response:
    user = caller(request)
    if not await run_in_threadpool(server(request).close_session, user, session_id):
        raise ResourceNotFoundError(f"no open session {session_id!r}")
    return reply(request, {})


@api.get("/futures/{future_id}", response_model=FutureReply)
async def get_future(future_id: str, request: Request, wait: float = 0.0) -> Response:
    """``wait``: seconds to long-poll (at most 60) for the future to finish."""
    future = await server(request).futures.wait(caller(request), future_id, wait)
    api = api_of(future.method)
    if api is not None:
        raise InvalidInputError(
            f"{future_id!r} is a request of the {api} API; poll it with that API's own call"
            " (the Tinker SDK's futures: POST /api/v1/retrieve_future)"
        )
    if future.status == "done":
        assert future.result is not None  # a done future holds its result
        return reply(request, {"status": "done", "result": wire.decode(future.result)})
    if future.status == "failed":
        return reply(request, {"status": "failed", "error": future.error})
    return reply(request, {"status": "pending"})


@api.post("/sample", response_model=FutureCreated)
async def sample(request: Request, body: Annotated[Sample, request_body(Sample)]) -> Response:
    """Sample with a run's current weights, a ``base_model`` checkpoint of the caller's, or the server's model."""
    user, state = caller(request), server(request)
    run_id, base_model = body.run_id, body.base_model
    if run_id is not None:
        owned_run(state, user, run_id)
    inputs = from_wire(body.inputs)
    params, num_samples = body.sampling_params, body.num_samples
    defaults = params or SamplingParams()
    n_prompts = len(inputs) if isinstance(inputs, list) else 1
    state.quotas.check_sampling(
        user, count_tokens(inputs), n_prompts, defaults.max_tokens, num_samples or defaults.num_samples
    )
    check_inputs_images(state, user, inputs)
    template = spec_dict(body.template)
    hold = None if base_model is None else hold_checkpoint(state, user, "", base_model)  # kept while the task runs
    release = hold.release if hold is not None else lambda: None
    try:
        future, created = state.futures.create(user, "sample", run_id, body.idempotency_key)
        if not created:
            release()
            return reply(request, {"future_id": future.id})

        def on_done(result: Any, error: BaseException | None) -> None:
            release()
            if error is None:
                state.futures.resolve(future.id, to_wire(result))
            else:
                state.futures.fail(future.id, error)

        base_path = None if hold is None else str(hold.path)
        task = PoolTask("sample", (run_id, inputs, params, num_samples, template, base_path))
        shared = SampleRequest(
            inputs, params, run_id=run_id, base_path=base_path, num_samples=num_samples, template=template or {}
        )
        # A run's samples keep their place among its calls (synced after its last step).
        slots = sample_slots(count_tokens(inputs), n_prompts, defaults.max_tokens, num_samples or defaults.num_samples)
        state.engine.submit(run_id or f"sample:{user}", task, on_done, shared, slots, (user, "sample"))
    except BaseException:
        release()
        raise
    return reply(request, {"future_id": future.id})


@api.post("/templates/encode", response_model=Features)
async def encode(request: Request, body: Annotated[Encode, request_body(Encode)]) -> Response:
    """Encode trajectories with a registered template of the server's model (the client has no tokenizer)."""
    user = caller(request)
    state, trajectories = server(request), body.trajectories
    check_inputs_images(state, user, trajectories, "trajectories")
    template = state.engine.template(spec_dict(body.template))
    add_generation_prompt = body.add_generation_prompt
    features = await run_in_threadpool(
        lambda: [template.encode(t, add_generation_prompt=add_generation_prompt) for t in trajectories]
    )
    return reply(request, {"features": features})


@api.post("/templates/decode", response_model=Texts)
async def decode(request: Request, body: Annotated[Decode, request_body(Decode)]) -> Response:
    caller(request)
    template = server(request).engine.template(spec_dict(body.template))
    texts = [template.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in body.token_ids]
    return reply(request, {"texts": texts})


@api.post("/datasets", response_model=DataHandle)
async def create_dataset(request: Request, body: Annotated[CreateDataset, request_body(CreateDataset)]) -> Response:
    user, state = caller(request), server(request)
    handle, length = await run_in_threadpool(state.data.create_dataset, user, body.model_dump(exclude_unset=True))
    return reply(request, {"handle": handle, "length": length})


@api.post("/dataloaders", response_model=DataHandle)
async def create_dataloader(
    request: Request, body: Annotated[CreateDataloader, request_body(CreateDataloader)]
) -> Response:
    user, state = caller(request), server(request)
    handle, length = await run_in_threadpool(state.data.create_dataloader, user, body.model_dump())
    return reply(request, {"handle": handle, "length": length})


@api.post("/dataloaders/{handle}/next", response_model=NextBatch)
async def next_batch(handle: str, request: Request, _: Annotated[Empty, request_body(Empty)]) -> Response:
    user = caller(request)
    batch = await run_in_threadpool(server(request).data.next_batch, user, handle)
    return reply(request, {"end": True} if batch is None else {"batch": batch})


@api.post("/dataloaders/{handle}/reset", response_model=Empty)
async def reset_dataloader(handle: str, request: Request, _: Annotated[Empty, request_body(Empty)]) -> Response:
    user = caller(request)
    server(request).data.reset(user, handle)
    return reply(request, {})
