"""Server error bodies back to the ``twinkle.errors`` classes, so remote code catches what local code catches.

The server answers an error as ``{"error": {"type": "<ClassName>", "message": "..."}}``
(a failed future carries the same ``error`` object). The client raises the class
named by ``type`` with the server's message, the HTTP status as ``status_code``
(``None`` for a failed future) and any further fields of the error object as
attributes (e.g. ``limit`` of a ``QuotaExceededError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

import twinkle.errors
from twinkle.errors import QuotaExceededError, ServerError, TwinkleError


def error_from_body(error: Any, status_code: int | None) -> TwinkleError:
    """The exception a server error object stands for; unknown types become :class:`ServerError`."""
    if not isinstance(error, Mapping) or not isinstance(error.get("message"), str):
        return _build(
            ServerError, f"the server reported a failure without an error message: {error!r:.300}", {}, status_code
        )
    type_name = str(error.get("type"))
    cls = getattr(twinkle.errors, type_name, None)
    message = error["message"]
    if not (isinstance(cls, type) and issubclass(cls, TwinkleError)):
        cls, message = ServerError, f"{type_name}: {message}"
    extras = {key: value for key, value in error.items() if key not in ("type", "message")}
    if issubclass(cls, QuotaExceededError):
        extras.setdefault("limit", None)
    return _build(cls, message, extras, status_code)


def error_from_response(response: httpx.Response, body: Any) -> TwinkleError:
    """The exception for an HTTP error response, given its decoded body (``None`` when it was not JSON or wire,
    e.g. a proxy's HTML page)."""
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        return error_from_body(body["error"], response.status_code)
    request = response.request
    message = f"HTTP {response.status_code} from {request.method} {request.url}: {response.text[:300]!r}"
    return _build(ServerError, message, {}, response.status_code)


def _build(cls: type[TwinkleError], message: str, extras: dict[str, Any], status_code: int | None) -> TwinkleError:
    """An instance with exactly the server's message: subclasses that format their own (``__init__`` with
    other arguments, e.g. ``MissingDependencyError``) are not re-run."""
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    exc.__dict__.update(extras, status_code=status_code)
    return exc
