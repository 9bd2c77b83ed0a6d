"""What every Tinker route shares: how operations are documented, the caller, replies."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.app.http import caller as authenticated_user
from twinkle.server.app.schemas.common import ErrorDetail
from twinkle.server.contract import ContractRoute
from twinkle.server.store.base import Run
from twinkle.server.tinker.jobs import Caller

PREFIX = "/api/v1"


class TinkerError(BaseModel):
    """An error reply of the Tinker API: the SDK shows ``detail``; ``error`` is the native error object."""

    detail: str = Field(description="What the SDK's exception says")
    error: ErrorDetail | None = None


class TinkerRoute(ContractRoute):
    """Tinker operations: request bodies are the SDK's own types, errors the SDK's shape, replies JSON."""

    error_model = TinkerError


def tinker_caller(request: Request) -> Caller:
    """The authenticated user (``X-API-Key: tml-...``) with the server's state."""
    return Caller(authenticated_user(request), request.app.state.server, request.app.state.tinker)


def reply(value: Any) -> JSONResponse:
    return JSONResponse(json.loads(json.dumps(value, default=str)))


def future(request_id: str, model_id: str | None = None, **extra: Any) -> JSONResponse:
    """``UntypedAPIFuture``: what every future-creating endpoint answers at once."""
    body: dict[str, Any] = {"request_id": request_id, **extra}
    if model_id is not None:
        body["model_id"] = model_id
    return JSONResponse(body)


def owned_run(caller: Caller, model_id: str) -> Run:
    run = caller.state.store.get_run(caller.user, model_id)
    if run is None:
        raise ResourceNotFoundError(f"no model {model_id!r}")
    return run


def resident_run(caller: Caller, model_id: str) -> Run:
    """The caller's run, which must be loaded (its session open) to train or save."""
    run = owned_run(caller, model_id)
    if not run.resident:
        raise ResourceNotFoundError(
            f"model {model_id!r} is not loaded (its session ended); create a training client from its checkpoint"
        )
    return run


def check_base_model(caller: Caller, base_model: str | None) -> None:
    """The server hosts one base model, known by its configured id or its local folder (which has the tokenizer)."""
    names = (caller.state.config.model_id, caller.state.engine.model_path)
    if base_model is not None and base_model not in names:
        raise InvalidInputError(
            f"unknown base model {base_model!r}; this server hosts {names[0]!r} (also {names[1]!r})"
        )
