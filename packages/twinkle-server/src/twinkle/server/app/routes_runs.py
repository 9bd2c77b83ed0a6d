"""Runs (a tenant's LoRA adapter on the shared base), their calls and their checkpoints."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from twinkle import wire
from twinkle.errors import ConfigurationError, ResourceNotFoundError
from twinkle.server.app import calls
from twinkle.server.app.http import caller, reply
from twinkle.server.app.routing import NativeRoute
from twinkle.server.app.schemas.calls import CallReply, CallRequest
from twinkle.server.app.schemas.common import Empty
from twinkle.server.app.schemas.runs import (
    CheckpointList,
    CheckpointListing,
    CreateRun,
    ResumeRun,
    RunCreated,
    RunList,
    RunListing,
    SetTtl,
)
from twinkle.server.app.state import ServerState
from twinkle.server.contract import request_body
from twinkle.server.services.convert import from_wire
from twinkle.server.services.engine import PoolTask
from twinkle.server.services.pool import SHORT_METHODS
from twinkle.server.services.runs import largest_rank, record_run
from twinkle.server.store.base import Checkpoint, Run

router = APIRouter(prefix="/twinkle/v1", route_class=NativeRoute)


def server(request: Request) -> ServerState:
    return request.app.state.server


def owned_run(state: ServerState, user: str, run_id: str) -> Run:
    run = state.store.get_run(user, run_id)
    if run is None:
        raise ResourceNotFoundError(f"no run {run_id!r}")
    return run


@router.post("/runs", response_model=RunCreated)
async def create_run(request: Request, body: Annotated[CreateRun, request_body(CreateRun)]) -> Response:
    user, state = caller(request), server(request)
    if body.base_model is not None:
        calls.resolve_checkpoint(state, user, "", body.base_model)  # a checkpoint of this user's, or 404
    steps, lora_config = body.gradient_accumulation_steps, body.lora_dict()
    run = record_run(state.store, state.quotas, user, body.session_id, lora_config, steps, body.base_model)
    try:
        await run_in_threadpool(_add_adapter, state, run, body.seed)
    except Exception:
        state.store.set_resident(user, run.id, False)
        raise
    return reply(request, {"run_id": run.id})


@router.get("/runs", response_model=RunList)
async def list_runs(request: Request) -> Response:
    user, state = caller(request), server(request)
    return reply(request, {"runs": [_listing(state, run) for run in state.store.list_runs(user)]})


@router.get("/runs/{run_id}", response_model=RunListing)
async def get_run(run_id: str, request: Request) -> Response:
    user, state = caller(request), server(request)
    return reply(request, _listing(state, owned_run(state, user, run_id)))


@router.post("/runs/{run_id}/resume", response_model=RunCreated)
async def resume_run(run_id: str, request: Request, body: Annotated[ResumeRun, request_body(ResumeRun)]) -> Response:
    """Put a run whose session ended back into the pool (then ``load`` a checkpoint into it)."""
    user, state = caller(request), server(request)
    run = owned_run(state, user, run_id)
    session_id = body.session_id
    if state.store.get_session(user, session_id) is None:
        raise ResourceNotFoundError(f"no open session {session_id!r}")
    if not run.resident:
        state.quotas.check_new_adapter(user, state.store.count_resident_runs(user), largest_rank(run.lora_config))
        await run_in_threadpool(_add_adapter, state, run)
    state.store.set_resident(user, run_id, True, session_id)
    return reply(request, {"run_id": run_id})


@router.post("/runs/{run_id}/call", response_model=CallReply)
async def call(
    run_id: str, request: Request, body: Annotated[CallRequest, request_body(CallRequest)], wait: float = 0.0
) -> Response:
    """Short methods answer ``{"result"}``; long ones (forward, backward, step, save, ...) ``{"future_id"}``, or
    ``{"result"}`` when they are done within ``wait`` seconds (at most 60): a client that would long-poll the
    future next is spared that request. A call that fails answers its ``future_id``, whose poll reports the error."""
    user, state = caller(request), server(request)
    run = owned_run(state, user, run_id)
    if not run.resident:
        raise ConfigurationError(f"run {run_id!r} is not in the pool (its session ended); resume it first")
    method, kwargs = body.method, from_wire(body.arguments())
    if method in SHORT_METHODS:
        result = await run_in_threadpool(calls.run_short_call, state, user, run_id, method, kwargs)
        return reply(request, {"result": result})
    future_id = calls.submit_long_call(state, user, run_id, method, kwargs, body.idempotency_key)
    if wait > 0:
        future = await state.futures.wait(user, future_id, wait)
        if future.status == "done" and future.result is not None:
            return reply(request, {"result": wire.decode(future.result)})
    return reply(request, {"future_id": future_id})


@router.get("/runs/{run_id}/checkpoints", response_model=CheckpointList)
async def list_checkpoints(run_id: str, request: Request) -> Response:
    user, state = caller(request), server(request)
    owned_run(state, user, run_id)
    return reply(request, {"checkpoints": _checkpoints(state, user, run_id)})


@router.delete("/runs/{run_id}/checkpoints/{name}", response_model=Empty)
async def delete_checkpoint(run_id: str, name: str, request: Request) -> Response:
    user, state = caller(request), server(request)
    owned_run(state, user, run_id)
    shown = calls.checkpoint_reference(run_id, name)
    await run_in_threadpool(state.checkpoints.delete, user, run_id, name, shown)
    return reply(request, {})


@router.put("/runs/{run_id}/checkpoints/{name}/ttl", response_model=CheckpointListing)
async def set_checkpoint_ttl(
    run_id: str, name: str, request: Request, body: Annotated[SetTtl, request_body(SetTtl)]
) -> Response:
    """``{"ttl_seconds": s}``: the checkpoint expires ``s`` seconds from now; ``null`` keeps it until deleted."""
    user, state = caller(request), server(request)
    owned_run(state, user, run_id)
    shown = calls.checkpoint_reference(run_id, name)
    return reply(request, _checkpoint(state.checkpoints.set_ttl(user, run_id, name, body.ttl_seconds, shown)))


def _listing(state: ServerState, run: Run) -> dict[str, Any]:
    listing = run.to_dict()
    listing["checkpoints"] = _checkpoints(state, run.user, run.id)
    return listing


def _checkpoints(state: ServerState, user: str, run_id: str) -> list[dict[str, Any]]:
    return [_checkpoint(checkpoint) for checkpoint in state.checkpoints.run_checkpoints(user, run_id) or []]


def _checkpoint(checkpoint: Checkpoint) -> dict[str, Any]:
    """A checkpoint with its ``twinkle://`` reference (server paths are not the tenant's business) and expiry."""
    listing = checkpoint.to_dict()
    listing["path"] = calls.checkpoint_reference(checkpoint.run_id, checkpoint.name)
    return listing


def _add_adapter(state: ServerState, run: Run, seed: int | None = None) -> None:
    """Load the run's adapter (or model); ``seed`` fixes its initial weights whatever else the server is doing."""
    hold = None if run.base_model is None else calls.hold_checkpoint(state, run.user, run.id, run.base_model)
    base_path = None if hold is None else str(hold.path)
    task = PoolTask("add_run", (run.id, run.lora_config, run.gradient_accumulation_steps, seed, base_path))
    try:
        state.engine.load_run(run.user, run.id, task, calls.SHORT_CALL_TIMEOUT_S)
    finally:
        if hold is not None:
            hold.release()
