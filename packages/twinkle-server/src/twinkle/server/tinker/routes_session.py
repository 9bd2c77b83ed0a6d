"""Client configuration, sessions, telemetry and server capabilities."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from twinkle.errors import ResourceNotFoundError
from twinkle.server.app.http import read_body
from twinkle.server.tinker.http import PREFIX, reply, tinker_caller

router = APIRouter(prefix=PREFIX)


@router.post("/client/config")
async def client_config(request: Request) -> JSONResponse:
    caller = tinker_caller(request)  # a wrong key fails when the client is built, not at its first call
    return reply(
        {
            "pjwt_auth_enabled": False,
            "fwdbwd_max_chunk_len": caller.state.config.tinker_chunk_datums,
            "custom_loss_server_side": False,
            "sample_use_retrieve_futures": False,
        }
    )


@router.post("/client/dynamic_config")
async def dynamic_config(request: Request) -> JSONResponse:
    tinker_caller(request)
    return reply({"refresh_interval_sec": 300, "sample_cancel_enabled": False})


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return reply({"status": "ok"})


@router.get("/get_server_capabilities")
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


@router.post("/create_session")
async def create_session(request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    session = caller.state.store.create_session(caller.user)
    return reply({"session_id": session.id, "type": "create_session"})


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> JSONResponse:
    caller, body = tinker_caller(request), await read_body(request)
    session_id = str(body.get("session_id"))
    if not caller.state.store.heartbeat(caller.user, session_id):
        # 410 stops the SDK's heartbeat loop: the session is over and its models were unloaded
        return JSONResponse({"detail": f"session {session_id!r} is closed or unknown"}, status_code=410)
    return reply({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, request: Request) -> JSONResponse:
    caller = tinker_caller(request)
    if not await run_in_threadpool(caller.state.close_session, caller.user, session_id):
        raise ResourceNotFoundError(f"no open session {session_id!r}")
    return reply({})


@router.post("/telemetry")
async def telemetry(request: Request) -> JSONResponse:
    """Accepted and dropped: the SDK's usage events are for the hosted service; this server has /metrics."""
    tinker_caller(request)
    return reply({"status": "accepted"})
