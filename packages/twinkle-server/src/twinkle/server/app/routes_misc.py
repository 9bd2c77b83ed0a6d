"""Health, metrics, server info, sessions, futures, sampling and server-side data."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from twinkle import wire
from twinkle.errors import InvalidInputError, PermissionDeniedError, ResourceNotFoundError
from twinkle.server.app.calls import count_tokens, hold_checkpoint
from twinkle.server.app.http import caller, read_body, reply
from twinkle.server.app.routes_runs import owned_run, server
from twinkle.server.services.convert import from_wire, to_wire
from twinkle.server.services.engine import PoolTask
from twinkle.server.services.futures import api_of

router = APIRouter()
api = APIRouter(prefix="/twinkle/v1")
MAX_WAIT_S = 60.0
VERSION = "0.1.0"
LOOPBACK = "127.0.0.1"


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    content, media_type = server(request).telemetry.render()
    return Response(content, media_type=media_type)


@router.get("/admin/replicas")
async def replicas(request: Request) -> Response:
    """Where runs execute (pids, runs, adapters): for the operator on this machine only, so no API key."""
    if request.client is None or request.client.host != LOOPBACK:
        raise PermissionDeniedError("/admin/replicas answers requests from 127.0.0.1 only")
    return reply(request, {"replicas": await run_in_threadpool(server(request).engine.replicas)})


@api.get("/server_info")
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


@api.post("/sessions")
async def create_session(request: Request) -> Response:
    user = caller(request)
    return reply(request, {"session_id": server(request).store.create_session(user).id})


@api.post("/sessions/{session_id}/heartbeat")
async def heartbeat(session_id: str, request: Request) -> Response:
    user = caller(request)
    if not server(request).store.heartbeat(user, session_id):
        raise ResourceNotFoundError(f"no open session {session_id!r} (it may have expired: create a new one)")
    return reply(request, {})


@api.delete("/sessions/{session_id}")
async def close_session(session_id: str, request: Request) -> Response:
    user = caller(request)
    if not await run_in_threadpool(server(request).close_session, user, session_id):
        raise ResourceNotFoundError(f"no open session {session_id!r}")
    return reply(request, {})


@api.get("/futures/{future_id}")
async def get_future(future_id: str, request: Request, wait: float = 0.0) -> Response:
    user = caller(request)
    timeout = min(max(wait, 0.0), MAX_WAIT_S)
    future = await server(request).futures.wait(user, future_id, timeout)
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


@api.post("/sample")
async def sample(request: Request) -> Response:
    """Sample with a run's current weights, a ``base_model`` checkpoint of the caller's, or the server's model."""
    user, body, state = caller(request), await read_body(request), server(request)
    run_id, base_model = body.get("run_id"), body.get("base_model")
    if run_id is not None:
        owned_run(state, user, run_id)
    inputs = from_wire(body.get("inputs"))
    state.quotas.check_tokens(user, count_tokens(inputs))
    template = body.get("template")
    if template is not None and not isinstance(template, dict):
        raise InvalidInputError("template must be {'name': <registered name>, 'kwargs': {...}}")
    hold = None if base_model is None else hold_checkpoint(state, user, "", base_model)  # kept while the task runs
    release = hold.release if hold is not None else lambda: None
    try:
        future, created = state.futures.create(user, "sample", run_id, body.get("idempotency_key"))
        if not created:
            release()
            return reply(request, {"future_id": future.id})
        params, num_samples = body.get("sampling_params"), body.get("num_samples")

        def on_done(result: Any, error: BaseException | None) -> None:
            release()
            if error is None:
                state.futures.resolve(future.id, to_wire(result))
            else:
                state.futures.fail(future.id, error)

        base_path = None if hold is None else str(hold.path)
        task = PoolTask("sample", (run_id, inputs, params, num_samples, template, base_path))
        state.engine.submit(run_id or f"sample:{user}", task, on_done, None, 0, (user, "sample"))
    except BaseException:
        release()
        raise
    return reply(request, {"future_id": future.id})


@api.post("/templates/encode")
async def encode(request: Request) -> Response:
    """Encode trajectories with a registered template of the server's model (the client has no tokenizer)."""
    caller(request)
    body, state = await read_body(request), server(request)
    trajectories = body.get("trajectories")
    if not isinstance(trajectories, list):
        raise InvalidInputError("trajectories must be a list of {'messages': [...]} objects")
    template = state.engine.template(body.get("template"))
    add_generation_prompt = bool(body.get("add_generation_prompt", False))
    features = await run_in_threadpool(
        lambda: [template.encode(t, add_generation_prompt=add_generation_prompt) for t in trajectories]
    )
    return reply(request, {"features": features})


@api.post("/templates/decode")
async def decode(request: Request) -> Response:
    caller(request)
    body, state = await read_body(request), server(request)
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not all(isinstance(ids, list) for ids in token_ids):
        raise InvalidInputError("token_ids must be a list of token-id lists")
    template = state.engine.template(body.get("template"))
    skip = bool(body.get("skip_special_tokens", False))
    texts = [template.decode(ids, skip_special_tokens=skip) for ids in token_ids]
    return reply(request, {"texts": texts})


@api.post("/datasets")
async def create_dataset(request: Request) -> Response:
    user, body, state = caller(request), await read_body(request), server(request)
    handle, length = await run_in_threadpool(state.data.create_dataset, user, body)
    return reply(request, {"handle": handle, "length": length})


@api.post("/dataloaders")
async def create_dataloader(request: Request) -> Response:
    user, body, state = caller(request), await read_body(request), server(request)
    handle, length = await run_in_threadpool(state.data.create_dataloader, user, body)
    return reply(request, {"handle": handle, "length": length})


@api.post("/dataloaders/{handle}/next")
async def next_batch(handle: str, request: Request) -> Response:
    user = caller(request)
    batch = await run_in_threadpool(server(request).data.next_batch, user, handle)
    return reply(request, {"end": True} if batch is None else {"batch": batch})


@api.post("/dataloaders/{handle}/reset")
async def reset_dataloader(handle: str, request: Request) -> Response:
    user = caller(request)
    server(request).data.reset(user, handle)
    return reply(request, {})
