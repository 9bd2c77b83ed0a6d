"""The HTTP application: ``create_app(config)`` for tests and embedding, ``run_server(config)`` for the CLI.

It mounts both APIs (native and Tinker) over one server state. It lives outside both API packages so that
importing either one (as a Ray replica does when it unpickles a task) never imports the other's routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from twinkle.errors import TwinkleError
from twinkle.server.app import routes_misc, routes_runs
from twinkle.server.app.http import error_reply
from twinkle.server.app.state import ServerState
from twinkle.server.config import ServerConfig
from twinkle.server.store import Store
from twinkle.server.tinker import app as tinker_api
from twinkle.server.tinker.replies import error_reply as tinker_error_reply


def create_app(config: ServerConfig, store: Store | None = None) -> FastAPI:
    """The server application; the model is loaded when the app starts (its lifespan), not here."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.server = ServerState.start(config, store)
        app.state.tinker = tinker_api.start(app.state.server)
        try:
            yield
        finally:
            app.state.server.stop()

    app = FastAPI(title="Twinkle server", version=routes_misc.VERSION, lifespan=lifespan)
    for router in (routes_misc.router, routes_misc.api, routes_runs.router):
        app.include_router(router)
    tinker_api.include_routers(app)

    # Expected errors (a TwinkleError names what the caller must fix) are answered here; anything else
    # is a server bug, answered 500 by the outermost handler (which also logs it).
    for error_class in (TwinkleError, RequestValidationError, Exception):
        app.add_exception_handler(error_class, _error_handler)

    return app


async def _error_handler(request: Request, exc: Exception) -> Response:
    if tinker_api.is_tinker_path(request.url.path):  # the SDK reads statuses and bodies its own way
        return tinker_error_reply(exc)
    return error_reply(request, exc)


def run_server(config: ServerConfig) -> None:
    """Serve until interrupted (what ``twinkle server`` runs)."""
    import uvicorn

    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info")
