"""Exceptions → HTTP status and JSON body ``{"error": {"type", "message"}}``.

``type`` is the class name in ``twinkle.errors`` that the client re-raises, so
a tenant gets the same exception remotely as in-process. Errors that are not
Twinkle's own are reported as ``ServerError`` (the client has no class for
them), keeping the original class name in the message for debugging.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError

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
        return 422, _body("InvalidInputError", f"malformed request body: {_validation_message(exc)}")
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            body = _body(type(exc).__name__ if _is_core(exc) else cls.__name__, str(exc))
            if isinstance(exc, QuotaExceededError):
                body["error"]["limit"] = exc.limit
            return status, body
    if isinstance(exc, TwinkleError) and _is_core(exc):
        return 500, _body(type(exc).__name__, str(exc))
    return 500, _body("ServerError", f"{type(exc).__name__}: {exc}")


def _body(type_name: str, message: str) -> dict[str, Any]:
    return {"error": {"type": type_name, "message": message}}


def _is_core(exc: BaseException) -> bool:
    """Only classes defined in ``twinkle.errors`` can be re-raised by name on the client."""
    return type(exc).__module__ == "twinkle.errors"


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        location = ".".join(str(item) for item in error.get("loc", ()))
        parts.append(f"{location}: {error.get('msg', 'invalid')}" if location else str(error.get("msg", "invalid")))
    return "; ".join(parts) or str(exc)
