"""The one Twinkle logger hierarchy (``twinkle.*``), configured once.

Level comes from ``TWINKLE_LOG_LEVEL`` (default ``INFO``). Libraries should not
configure the root logger, so only the ``twinkle`` logger gets a handler.
"""

from __future__ import annotations

import logging
import os

_ROOT = "twinkle"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(levelname)s:%(name)s] %(message)s"))
        root.addHandler(handler)
    root.setLevel(os.environ.get("TWINKLE_LOG_LEVEL", "INFO").upper())
    root.propagate = False
    _configured = True


def get_logger(name: str | None = None) -> logging.Logger:
    """Return ``twinkle`` or a child logger; ``name`` is usually ``__name__``."""
    _configure_root()
    if not name or name == _ROOT:
        return logging.getLogger(_ROOT)
    if not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
