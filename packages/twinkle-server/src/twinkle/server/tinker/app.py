"""Mounting the Tinker API on the server application."""

from __future__ import annotations

from fastapi import FastAPI

from twinkle.server.app.state import ServerState
from twinkle.server.tinker import routes_rest, routes_sampling, routes_session, routes_training
from twinkle.server.tinker.http import PREFIX
from twinkle.server.tinker.jobs import drop_sampler_adapters
from twinkle.server.tinker.state import TinkerState

ROUTERS = (routes_session.router, routes_training.router, routes_sampling.router, routes_rest.router)


def include_routers(app: FastAPI) -> None:
    for router in ROUTERS:
        app.include_router(router)


def start(state: ServerState) -> TinkerState:
    """The Tinker API's in-memory state, told when a run's adapter leaves the pool."""
    tinker = TinkerState()

    def on_run_released(run_id: str) -> None:
        tinker.gate.close(run_id)
        drop_sampler_adapters(state, "", run_id, tinker.drop_run(run_id))  # its snapshots, in its pool's sampler

    state.release_hooks.append(on_run_released)
    return tinker


def is_tinker_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")
