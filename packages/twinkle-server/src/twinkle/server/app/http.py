"""Request bodies in, responses out (wire codec or JSON), the caller's identity, errors as statuses."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from twinkle import wire
from twinkle.errors import InvalidInputError
from twinkle.server.auth import authenticate
from twinkle.server.errors import error_response

MAX_BODY_BYTES = 256 * 1024 * 1024


class MalformedBodyError(InvalidInputError):
    """The body is not valid wire-codec or JSON data (answered with 422)."""


async def read_body(request: Request) -> dict[str, Any]:
    """The request's object body, from the wire codec or JSON (an empty body is ``{}``)."""
    try:
        data = await request.body()
    except ClientDisconnect as exc:  # the caller hung up mid-body: its mistake, with no one left to answer
        raise MalformedBodyError("the client disconnected before sending the whole body") from exc
    if len(data) > MAX_BODY_BYTES:
        raise InvalidInputError(f"the body has {len(data)} bytes; the limit is {MAX_BODY_BYTES}")
    if not data:
        return {}
    try:
        if request.headers.get("content-type", "").startswith(wire.CONTENT_TYPE):
            body = wire.decode(data)
        else:
            body = json.loads(data)
    except (InvalidInputError, ValueError) as exc:
        raise MalformedBodyError(f"malformed request body: {exc}") from exc
    if not isinstance(body, dict):
        raise MalformedBodyError(f"the request body must be an object, got {type(body).__name__}")
    return body


def reply(request: Request, value: Any, status: int = 200) -> Response:
    """``value`` in the wire codec when the client accepts it, else JSON (arrays as lists)."""
    if wire.CONTENT_TYPE in request.headers.get("accept", ""):
        return Response(wire.encode(value), status_code=status, media_type=wire.CONTENT_TYPE)
    return JSONResponse(_jsonable(value), status_code=status)


def caller(request: Request) -> str:
    """The user whose API key came with the request (``Authorization: Bearer`` or ``X-API-Key``); asked
    once per request (the body's reader and the route both want it, the rate limit counts it once)."""
    user = getattr(request.state, "user", None)
    if user is None:
        header = request.headers.get("authorization") or request.headers.get("x-api-key")
        user = authenticate(request.app.state.server.store, header)
        request.app.state.server.quotas.check_rate(user)
        request.state.user = user
    return str(user)


def error_reply(request: Request, exc: BaseException) -> Response:
    status, body = error_response(exc)
    if isinstance(exc, MalformedBodyError):
        status = 422
    response = reply(request, body, status)
    if isinstance(exc, HTTPException) and exc.headers:
        response.headers.update(exc.headers)  # e.g. Allow of a 405
    return response


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; the wire codec keeps them exactly
    return value
