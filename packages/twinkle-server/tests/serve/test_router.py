"""``PinnedReplicaRouter`` and the ``live`` list it keeps: a call reaches the replica it names, or fails."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from twinkle.server.services.serve import live
from twinkle.server.services.serve.router import PinnedReplicaRouter

DEPLOYMENT = DeploymentID(name="model", app_name="router-test")


def _router() -> PinnedReplicaRouter:
    router = PinnedReplicaRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state(app=DEPLOYMENT.app_name)
    return router


def _replica(unique_id: str) -> SimpleNamespace:  # what ``choose_replicas`` reads of a RunningReplica
    return SimpleNamespace(replica_id=ReplicaID(unique_id, DEPLOYMENT))


def _choose(router: PinnedReplicaRouter, candidates: list, *args: object) -> tuple[list, PendingRequest]:
    async def choose() -> tuple[list, PendingRequest]:
        request = PendingRequest(args=list(args), kwargs={}, metadata=RequestMetadata("r", "r", call_method="apply"))
        return await router.choose_replicas(candidates, request), request

    return asyncio.run(choose())


def test_a_call_goes_to_the_replica_it_names_and_an_unaddressed_one_anywhere():
    a, b = _replica("a"), _replica("b")
    assert _choose(_router(), [a, b], "b", "task")[0] == [[b]]
    assert _choose(_router(), [a, b], None)[0] == [[a, b]]


def test_a_call_for_a_replica_that_is_gone_fails_at_once_with_its_name():
    a = _replica("a")
    ranks, request = _choose(_router(), [a], "gone", "task")
    assert ranks == [[a]]  # non-empty, so Serve looks at the request again, sees it failed, and drops it
    with pytest.raises(live.ReplicaGoneError, match="replica gone is no longer running"):
        request.future.result()


def test_the_live_list_reaches_its_listener_once_per_change_until_forgotten():
    seen: list[list[str]] = []
    live.subscribe("live-test", seen.append)
    try:
        live.publish("live-test", ["b", "a"])
        live.publish("live-test", ["a", "b"])  # the same replicas: no news
        live.publish("live-test", ["b"])
        assert seen == [["a", "b"], ["b"]]
    finally:
        live.subscribe("live-test", None)
    live.publish("live-test", ["c"])
    assert seen == [["a", "b"], ["b"]]  # forgotten
