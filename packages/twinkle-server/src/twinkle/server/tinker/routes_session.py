"""Client configuration, sessions, telemetry and server capabilities."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from tinker import types

from twinkle.errors import ResourceNotFoundError
from twinkle.server.app.schemas.common import Empty
from twinkle.server.contract import request_body
from twinkle.server.tinker.http import PREFIX, TinkerError, TinkerRoute, reply, tinker_caller

router = APIRouter(prefix=PREFIX, route_class=TinkerRoute, tags=["tinker"])


@router.post("/client/config", response_model=types.ClientConfigResponse)
async def client_config(
    request: Request, _: Annotated[types.ClientConfigRequest, request_body(types.ClientConfigRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)  # a wrong key fails when the client is built, not at its first call
    return reply(
        {
            "pjwt_auth_enabled": False,
            "fwdbwd_max_chunk_len": caller.state.config.tinker_chunk_datums,
            "custom_loss_server_side": False,
            "sample_use_retrieve_futures": False,
        }
    )


@router.post("/client/dynamic_config", response_model=types.ClientDynamicConfigResponse)
async def dynamic_config(
    request: Request, _: Annotated[types.ClientConfigRequest, request_body(types.ClientConfigRequest)]
) -> JSONResponse:
    tinker_caller(request)
    return reply({"refresh_interval_sec": 300, "sample_cancel_enabled": False})


@router.get("/healthz", response_model=types.HealthResponse)
async def healthz() -> JSONResponse:
    return reply({"status": "ok"})


@router.get("/get_server_capabilities", response_model=types.GetServerCapabilitiesResponse)
async def capabilities(request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    state = caller.state
    return reply(
        {
            "supported_models": [
                {
                    "model_name": state.config.model_id,
                    "max_context_length": state.engine.max_length,
                    "trainable": True,
                    "sampleable": True,
                }
            ]
        }
    )


@router.post("/create_session", response_model=types.CreateSessionResponse)
async def create_session(
    request: Request, _: Annotated[types.CreateSessionRequest, request_body(types.CreateSessionRequest)]
) -> JSONResponse:
    caller = tinker_caller(request)
    session = caller.state.store.create_session(caller.user)
    return reply({"session_id": session.id, "type": "create_session"})


SESSION_GONE: dict[int | str, dict[str, Any]] = {
    410: {"model": TinkerError, "description": "The session is closed or unknown (the SDK stops beating)"}
}


@router.post("/session_heartbeat", response_model=types.SessionHeartbeatResponse, responses=SESSION_GONE)
async def session_heartbeat(
    request: Request, body: Annotated[types.SessionHeartbeatRequest, request_body(types.SessionHeartbeatRequest)]
) -> JSONResponse:
    caller, session_id = tinker_caller(request), body.session_id
    if not caller.state.store.heartbeat(caller.user, session_id):
        # 410 stops the SDK's heartbeat loop: the session is over and its models were unloaded
        return JSONResponse({"detail": f"session {session_id!r} is closed or unknown"}, status_code=410)
    return reply({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish", response_model=Empty)
async def finish_session(
    session_id: str,
    request: Request,
    _: Annotated[types.ClientSessionFinished, request_body(types.ClientSessionFinished)],
) -> JSONResponse:
    caller = tinker_caller(request)
    if not await run_in_threadpool(caller.state.close_session, caller.user, session_id):
        raise ResourceNotFoundError(f"no open session {session_id!r}")
    return reply({})


@router.post("/telemetry", response_model=types.TelemetryResponse)
async def telemetry(
    request: Request, _: Annotated[types.TelemetrySendRequest, request_body(types.TelemetrySendRequest)]
) -> JSONResponse:
    """Accepted and dropped: the SDK's usage events are for the hosted service; this server has /metrics."""
    tinker_caller(request)
    return reply({"status": "accepted"})
