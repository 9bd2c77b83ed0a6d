"""HTTP APIs served beside the native one: plugins published in the entry-point group ``twinkle.server.apis``.

An API translates its own wire format to the shared server state (sessions, runs, checkpoints, calls and
futures live there, once); the native routes import nothing from any plugin. twinkle-server publishes the
Tinker API this way as ``tinker``, whose SDK dependencies come with the ``twinkle-server[tinker]`` extra. By
convention a plugin's optional dependencies are its distribution's extra of the API's name.

``apis:`` in the server config names the APIs to serve; without it, every installed one that imports is
served, and one whose dependencies are missing is skipped with a warning that says what to install.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Protocol

from twinkle.errors import ConfigurationError

if TYPE_CHECKING:  # config.py reads the installed names; it needs none of these
    from fastapi import FastAPI
    from fastapi.responses import Response

    from twinkle.server.app.state import ServerState

ENTRY_POINT_GROUP = "twinkle.server.apis"

logger = logging.getLogger(__name__)


class ServerApi(Protocol):
    """One HTTP API over the shared server state; its entry point names an instance."""

    #: Its name in ``apis:``; its own state is kept as ``app.state.<name>``.
    name: str

    def include_routers(self, app: FastAPI) -> None:
        """Add its routes to the application."""

    def start(self, state: ServerState) -> object:
        """Its own state beside the server's, made when the server starts (hooks registered here)."""

    def owns(self, path: str) -> bool:
        """Whether a request path is one of its routes (its errors are then answered in its format)."""

    def error_reply(self, exc: Exception) -> Response:
        """The reply to an error raised while serving one of its routes."""


def installed_api_names() -> list[str]:
    """Every API published in the entry-point group (without importing any)."""
    return sorted(_entry_points())


def load_apis(names: Sequence[str] | None) -> list[ServerApi]:
    """The APIs named (each must load), or, for None, every installed one whose dependencies are installed."""
    available = _entry_points()
    if names is not None:
        unknown = [name for name in names if name not in available]
        if unknown:
            raise ConfigurationError(
                f"apis: no server API named {unknown}; installed: {', '.join(sorted(available)) or 'none'}"
            )
    apis = []
    for name in sorted(available) if names is None else names:
        entry_point = available[name]
        try:
            api = entry_point.load()
        except ModuleNotFoundError as exc:
            hint = f"pip install '{entry_point.dist.name}[{name}]'" if entry_point.dist else "install what it needs"
            message = f"the {name} API needs the module {exc.name!r}, which is not installed: {hint}"
            if names is not None:
                raise ConfigurationError(message) from exc
            logger.warning("%s; serving without it", message)
            continue
        if getattr(api, "name", None) != name:
            raise ConfigurationError(f"entry point {entry_point.value!r} is not the server API {name!r}")
        apis.append(api)
    return apis


def _entry_points() -> dict[str, EntryPoint]:
    return {entry_point.name: entry_point for entry_point in entry_points(group=ENTRY_POINT_GROUP)}
