"""Exception types shared by every Twinkle package.

Each error names the offending input so that a user (or a remote tenant, once
errors travel over HTTP) can fix the call without reading a traceback.
"""

from __future__ import annotations


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
