"""What the Tinker API answers: stored future results, ``retrieve_future`` replies and errors.

A Tinker future's result is stored exactly as it will be sent, tagged with its
content type (protobuf for ``forward_backward`` and ``asample``, JSON for the
rest), so a poll repeated after a lost response gets the same bytes.
Errors follow what the SDK does with them: a failed future is a 200 JSON
``{error, category}`` (the SDK raises ``RequestFailedError``), and a bad request
is a 4xx the SDK does not retry — never 409, which it retries for minutes.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse, Response

from twinkle.server.errors import error_response
from twinkle.server.store.base import Future

PROTO_MEDIA_TYPE = "application/x-protobuf"
_PROTO, _JSON = b"P", b"J"
# Errors a tenant caused (and must fix) as opposed to the server's own failures.
USER_ERROR_TYPES = frozenset(
    {
        "InvalidInputError",
        "ComponentNotFoundError",
        "ConfigurationError",
        "ResourceNotFoundError",
        "PermissionDeniedError",
        "QuotaExceededError",
        "RateLimitError",
        "AuthenticationError",
    }
)
# How long a retrieve_future poll waits: under the SDK's 45 s read timeout, since it re-polls at once.
POLL_WAIT_S = 25.0


def proto_result(body: bytes) -> bytes:
    return _PROTO + body


def json_result(value: Any) -> bytes:
    return _JSON + json.dumps(value).encode("utf-8")


def future_reply(future: Future) -> Response:
    if future.status == "done" and future.result is not None:
        tag, body = future.result[:1], future.result[1:]
        if tag == _PROTO:
            return Response(body, media_type=PROTO_MEDIA_TYPE)
        return Response(body, media_type="application/json")
    if future.status == "failed":
        error = future.error or {}
        category = "user" if error.get("type") in USER_ERROR_TYPES else "server"
        message = f"{error.get('type', 'Error')}: {error.get('message', '')}"
        return JSONResponse({"error": message, "category": category})
    return JSONResponse({"type": "try_again", "request_id": future.id, "queue_state": "active"})


def error_reply(exc: BaseException) -> Response:
    """An HTTP error for a Tinker endpoint; ``detail`` is what the SDK's exception message shows."""
    status, body = error_response(exc)
    if status == 409:  # a configuration problem is permanent, but the SDK would retry a 409 for minutes
        status = 400
    message = f"{body['error']['type']}: {body['error']['message']}"
    return JSONResponse({"detail": message, **body}, status_code=status)
