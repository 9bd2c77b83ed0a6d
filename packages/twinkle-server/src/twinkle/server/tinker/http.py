"""What every Tinker route shares: the caller, request bodies parsed with the SDK's own types, replies."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.app.http import caller as authenticated_user
from twinkle.server.app.http import read_body
from twinkle.server.store.base import Run
from twinkle.server.tinker.jobs import Caller

PREFIX = "/api/v1"
ModelT = TypeVar("ModelT", bound=BaseModel)


def tinker_caller(request: Request) -> Caller:
    """The authenticated user (``X-API-Key: tml-...``) with the server's state."""
    return Caller(authenticated_user(request), request.app.state.server, request.app.state.tinker)


async def parse(request: Request, model: type[ModelT]) -> ModelT:
    """The JSON body as the SDK's request type; a mismatch is the caller's 400 naming the fields."""
    body = await read_body(request)
    return validate(model, body)


def validate(model: type[ModelT], body: Any) -> ModelT:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}" for error in exc.errors()
        )
        raise InvalidInputError(f"invalid {model.__name__}: {problems}") from None


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
