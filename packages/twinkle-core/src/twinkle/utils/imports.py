"""Lazy imports of optional back-ends with an error that names what to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from twinkle.errors import MissingDependencyError


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming ``extra``.

    ``extra`` is the pip requirement that provides it, e.g. ``"twinkle-hub[modelscope]"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module, extra, purpose) from exc
