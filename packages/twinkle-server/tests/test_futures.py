"""A poller of a future of this process is handed the future as stored, and never another user's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from twinkle import wire
from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.services.futures import Futures
from twinkle.server.store import SQLiteStore


@pytest.fixture
def futures(tmp_path, clock):
    with SQLiteStore(tmp_path / "twinkle.db", clock=clock) as store:
        for user in ("alice", "bob"):
            store.add_user(user)
        yield Futures(store)


def _finish_soon(action) -> None:
    threading.Timer(0.05, action).start()  # from another thread, as the scheduler's worker finishes calls


def test_a_waiting_poller_gets_the_finished_future_as_the_store_holds_it(futures, clock):
    future, _ = futures.create("alice", "forward_backward", None, None)
    clock.now += 3
    _finish_soon(lambda: futures.resolve(future.id, {"loss": 1.5}))
    waited = asyncio.run(futures.wait("alice", future.id, 10))
    assert waited == futures.store.get_future("alice", future.id)
    assert (waited.status, wire.decode(waited.result), waited.finished_at) == ("done", {"loss": 1.5}, 1003)

    failing, _ = futures.create("alice", "step", None, None)
    _finish_soon(lambda: futures.fail(failing.id, InvalidInputError("bad batch")))
    waited = asyncio.run(futures.wait("alice", failing.id, 10))
    assert waited == futures.store.get_future("alice", failing.id)
    assert waited.status == "failed" and waited.error["message"] == "bad batch"


def test_another_users_future_is_not_found_while_running_or_done(futures):
    future, _ = futures.create("alice", "forward_backward", None, None)
    with pytest.raises(ResourceNotFoundError, match="no future"):
        asyncio.run(futures.wait("bob", future.id, 0.1))
    futures.resolve(future.id, 1)
    with pytest.raises(ResourceNotFoundError, match="no future"):
        asyncio.run(futures.wait("bob", future.id, 0.1))


def test_a_poll_that_times_out_reports_the_future_pending(futures):
    future, _ = futures.create("alice", "forward_backward", None, None)
    assert asyncio.run(futures.wait("alice", future.id, 0.05)).status == "pending"
    assert asyncio.run(futures.wait("alice", future.id, 0)).status == "pending"


def test_a_future_the_store_finished_first_is_reported_as_the_store_has_it(futures):
    """E.g. failed by a restart's clean-up: the late result does not overwrite it, and the poller hears the
    store's version."""
    future, _ = futures.create("alice", "forward_backward", None, None)
    futures.store.mark_inflight_futures_failed("the server restarted")
    _finish_soon(lambda: futures.resolve(future.id, {"loss": 1.5}))
    waited = asyncio.run(futures.wait("alice", future.id, 10))
    assert waited.status == "failed" and "restarted" in waited.error["message"]
