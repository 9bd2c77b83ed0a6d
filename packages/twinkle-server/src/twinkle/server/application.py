"""The HTTP application: ``create_app(config)`` for tests and embedding, ``run_server(config)`` for the CLI.

It mounts the native API and the configured API plugins (:mod:`twinkle.server.apis`, the Tinker API among
them) over one server state. It lives outside every API package so that importing one (as a Ray replica does
when it unpickles a task) never imports another's routes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from twinkle.errors import TwinkleError
from twinkle.server.apis import ServerApi, load_apis
from twinkle.server.app import routes_misc, routes_runs
from twinkle.server.app.http import error_reply
from twinkle.server.app.state import ServerState
from twinkle.server.config import ServerConfig
from twinkle.server.contract import install_openapi
from twinkle.server.store import Store

DESCRIPTION = (
    "One base model, many tenants training their own LoRA adapters. Native API under `/twinkle/v1` (the "
    "`twinkle_client` package speaks it); the Tinker API under `/api/v1` when installed. Request and reply bodies "
    "are JSON, or the binary wire codec `application/vnd.twinkle.v1` (numeric arrays kept exact; send it as "
    '`Content-Type`, ask for it with `Accept`). Native errors are `{"error": {"type", "message", '
    '"field", "limit"}}`; `type` names the exception class in `twinkle.errors`.'
)


def create_app(config: ServerConfig, store: Store | None = None) -> FastAPI:
    """The server application; the model is loaded when the app starts (its lifespan), not here."""
    apis = load_apis(config.apis)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.server = ServerState.start(config, store)
        for api in apis:
            setattr(app.state, api.name, api.start(app.state.server))
        try:
            yield
        finally:
            app.state.server.stop()

    app = FastAPI(title="Twinkle server", version=routes_misc.VERSION, lifespan=lifespan)
    for router in (routes_misc.router, routes_misc.api, routes_runs.router):
        app.include_router(router)
    for api in apis:
        api.include_routers(app)

    # Expected errors (a TwinkleError names what the caller must fix) are answered here; anything else
    # is a server bug, answered 500 by the outermost handler (which also logs it).
    for error_class in (TwinkleError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(error_class, _error_handler(apis))
    install_openapi(app, DESCRIPTION)
    return app


def _error_handler(apis: list[ServerApi]) -> Callable[[Request, Exception], Awaitable[Response]]:
    """Errors on an API plugin's routes are answered in its own format (its clients read them their way)."""

    async def handle(request: Request, exc: Exception) -> Response:
        for api in apis:
            if api.owns(request.url.path):
                return api.error_reply(exc)
        return error_reply(request, exc)

    return handle


def run_server(config: ServerConfig) -> None:
    """Serve until interrupted (what ``twinkle server`` runs)."""
    import uvicorn

    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info")
