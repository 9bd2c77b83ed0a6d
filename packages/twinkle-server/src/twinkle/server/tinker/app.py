"""The Tinker API as a server plugin: entry point ``tinker`` in the group ``twinkle.server.apis``."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from twinkle.server.app.state import ServerState
from twinkle.server.tinker import routes_rest, routes_sampling, routes_session, routes_training
from twinkle.server.tinker.checkpoints import sampler_adapter_name
from twinkle.server.tinker.http import PREFIX
from twinkle.server.tinker.jobs import drop_sampler_adapters
from twinkle.server.tinker.paths import CheckpointPath
from twinkle.server.tinker.replies import error_reply
from twinkle.server.tinker.state import TinkerState

ROUTERS = (routes_session.router, routes_training.router, routes_sampling.router, routes_rest.router)


class TinkerApi:
    """``/api/v1``: the unmodified ``tinker`` SDK and tinker-cookbook recipes train against the server."""

    name = "tinker"

    def include_routers(self, app: FastAPI) -> None:
        for router in ROUTERS:
            app.include_router(router)

    def start(self, state: ServerState) -> TinkerState:
        """The API's in-memory state, told when a run's adapter leaves the pool or a checkpoint is gone."""
        tinker = TinkerState()

        def on_run_released(run_id: str) -> None:
            tinker.gate.close(run_id)
            drop_sampler_adapters(state, "", run_id, tinker.drop_run(run_id))  # its snapshots, in its pool's sampler

        def on_checkpoint_removed(user: str, run_id: str, name: str) -> None:
            """A deleted or expired checkpoint's adapter leaves every sampler that loaded it."""
            adapter = sampler_adapter_name(user, CheckpointPath.from_store_name(run_id, name))
            for replica in tinker.forget_loaded(adapter):
                drop_sampler_adapters(state, user, run_id, [adapter], replica)

        state.release_hooks.append(on_run_released)
        state.checkpoints.removed_hooks.append(on_checkpoint_removed)
        return tinker

    def owns(self, path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    def error_reply(self, exc: Exception) -> Response:
        """The SDK reads statuses and bodies its own way (see ``replies``)."""
        return error_reply(exc)


API = TinkerApi()
