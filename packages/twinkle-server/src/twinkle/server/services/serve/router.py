"""Serve's request router for the model deployment: a call goes to the replica named by its first argument.

A run's adapter, optimizer and gradients live in one replica's memory, so its
calls must all reach that replica (Serve's multiplexing only prefers one). A
call addressed to a replica that has died fails with ``ReplicaGoneError``
instead of waiting for it; a call addressed to no replica (``None``) goes to
any. The router also publishes the live replicas for the engine (``live``).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from twinkle.server.services.serve import live


class PinnedReplicaRouter(RequestRouter):
    def initialize_state(self, app: str) -> None:  # type: ignore[override]  # Serve passes request_router_kwargs
        self._app, self._live_ids = app, set[str]()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not pending_request.args or pending_request.args[0] is None:
            return [candidate_replicas]
        target = pending_request.args[0]
        chosen = [replica for replica in candidate_replicas if replica.replica_id.unique_id == target]
        if chosen:
            return [chosen]
        if not pending_request.future.done():
            pending_request.future.set_exception(live.ReplicaGoneError(target))
        return [candidate_replicas]  # Serve checks the request before sending it, sees it failed, and drops it

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._live_ids = {replica.replica_id.unique_id for replica in replicas}
        live.publish(self._app, list(self._live_ids))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._live_ids.discard(replica_id.unique_id)  # before the controller notices: a call on it just failed
        live.publish(self._app, list(self._live_ids))
