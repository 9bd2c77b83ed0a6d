"""Exception types shared by every Twinkle package.

Each error names the offending input so that a user (or a remote tenant, once
errors travel over HTTP) can fix the call without reading a traceback.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ComponentNotFoundError",
    "ConfigurationError",
    "InvalidInputError",
    "MissingDependencyError",
    "PermissionDeniedError",
    "QuotaExceededError",
    "RateLimitError",
    "ResourceNotFoundError",
    "ServerError",
    "TwinkleError",
]


class TwinkleError(Exception):
    """Base class of all errors raised on purpose by Twinkle."""


class InvalidInputError(TwinkleError, ValueError):
    """A caller passed data or arguments that cannot be used (bad shape, type, range)."""


class ConfigurationError(TwinkleError, ValueError):
    """A component or run was configured inconsistently."""


class ComponentNotFoundError(TwinkleError, LookupError):
    """A registered name (loss, optimizer, preprocessor, ...) is unknown."""


class ResourceNotFoundError(TwinkleError, FileNotFoundError):
    """A model, dataset or file reference could not be resolved to local data."""


class MissingDependencyError(TwinkleError, ImportError):
    """An optional back-end is needed but not installed; the message names the extra."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        super().__init__(f"{purpose} needs the optional package '{module}'. Install it with: pip install '{extra}'")
        self.module = module
        self.extra = extra


class AuthenticationError(TwinkleError):
    """A server request came without a valid API key."""


class PermissionDeniedError(TwinkleError):
    """The caller is known but may not do this (another user's resource, a forbidden setting)."""


class QuotaExceededError(TwinkleError):
    """A per-user limit was reached; ``limit`` names it (e.g. ``'max_adapters'``, ``'requests_per_second'``)."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class RateLimitError(QuotaExceededError):
    """Too many requests in a short time; retry later."""

    def __init__(self, message: str, limit: str = "requests_per_second") -> None:
        super().__init__(message, limit)


class ServerError(TwinkleError):
    """A remote server failed in a way that has no more specific error type."""
