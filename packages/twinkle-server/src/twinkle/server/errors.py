"""Exceptions → HTTP status and JSON body ``{"error": {"type", "message", "field", "limit"}}``.

``type`` is the class name in ``twinkle.errors`` that the client re-raises, so
a tenant gets the same exception remotely as in-process; ``field`` (when set)
is the dotted body field at fault, ``limit`` the quota that was hit. HTTP
errors of the framework (an unknown path, a method the path does not take)
come in the same shape. Errors that are not Twinkle's own are reported as
``ServerError`` (the client has no class for them), keeping the original
class name in the message for debugging.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from twinkle.errors import (
    AuthenticationError,
    ComponentNotFoundError,
    ConfigurationError,
    InvalidInputError,
    PermissionDeniedError,
    QuotaExceededError,
    RateLimitError,
    ResourceNotFoundError,
    TwinkleError,
)

# Most specific first: RateLimitError is a QuotaExceededError.
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (InvalidInputError, 400),
    # An unknown loss/optimizer/template name is the caller's mistake; a 5xx would invite pointless retries.
    (ComponentNotFoundError, 400),
    (AuthenticationError, 401),
    (PermissionDeniedError, 403),
    (RateLimitError, 429),
    (QuotaExceededError, 403),
    (ResourceNotFoundError, 404),
    (ConfigurationError, 409),
)


def error_response(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body reporting ``exc`` to a client."""
    if isinstance(exc, RequestValidationError):
        body = _body("InvalidInputError", f"malformed request: {_validation_message(exc)}")
        locations = [_location(error) for error in exc.errors()]
        if locations and locations[0]:
            body["error"]["field"] = locations[0]
        return 422, body
    if isinstance(exc, HTTPException):
        return exc.status_code, _body(_HTTP_ERRORS.get(exc.status_code, "InvalidInputError"), str(exc.detail))
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            body = _body(type(exc).__name__ if _is_core(exc) else cls.__name__, str(exc))
            if isinstance(exc, QuotaExceededError):
                body["error"]["limit"] = exc.limit
            if getattr(exc, "field", None) is not None:
                body["error"]["field"] = exc.field  # type: ignore[attr-defined]  # set by the HTTP edge's validation
            return status, body
    if isinstance(exc, TwinkleError) and _is_core(exc):
        return 500, _body(type(exc).__name__, str(exc))
    return 500, _body("ServerError", f"{type(exc).__name__}: {exc}")


def _body(type_name: str, message: str) -> dict[str, Any]:
    return {"error": {"type": type_name, "message": message}}


def _is_core(exc: BaseException) -> bool:
    """Only classes defined in ``twinkle.errors`` can be re-raised by name on the client."""
    return type(exc).__module__ == "twinkle.errors"


_HTTP_ERRORS = {401: "AuthenticationError", 403: "PermissionDeniedError", 404: "ResourceNotFoundError"}


def _location(error: Any) -> str:
    return ".".join(str(item) for item in error.get("loc", ()))


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        location = _location(error)
        parts.append(f"{location}: {error.get('msg', 'invalid')}" if location else str(error.get("msg", "invalid")))
    return "; ".join(parts) or str(exc)
