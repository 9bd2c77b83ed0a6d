"""Sampling sessions and snapshot adapters kept by the Tinker API."""

from __future__ import annotations

import pytest

from twinkle.errors import ResourceNotFoundError
from twinkle.server.tinker.state import MAX_SNAPSHOTS_PER_RUN, SamplingSession, TinkerState


def snapshot_session(state: TinkerState, run: str, index: int) -> SamplingSession:
    adapter = f"{run}:sample:{index}"
    session = SamplingSession(adapter, "alice", "base", None, adapter=adapter, run_id=run)
    state.add_session(session)
    return session


def test_a_run_keeps_its_newest_snapshots_and_older_sessions_say_why_they_stopped():
    state = TinkerState()
    dropped = []
    sessions = []
    for index in range(MAX_SNAPSHOTS_PER_RUN + 2):
        sessions.append(snapshot_session(state, "run", index))
        dropped += state.add_snapshot("run", sessions[-1].adapter)
    assert dropped == [sessions[0].adapter, sessions[1].adapter]
    with pytest.raises(ResourceNotFoundError, match="save the weights for sampling again"):
        state.session("alice", sessions[0].id)
    assert state.session("alice", sessions[-1].id) == sessions[-1]
    assert sorted(state.drop_run("run")) == sorted(s.adapter for s in sessions[2:])


def test_sessions_belong_to_their_user():
    state = TinkerState()
    state.add_session(SamplingSession("s1", "alice", "base", None, None))
    assert state.session("alice", "s1").id == "s1"
    with pytest.raises(ResourceNotFoundError):
        state.session("bob", "s1")


def test_inflight_sessions_share_one_adapter_until_the_run_is_dropped():
    state = TinkerState()
    session = SamplingSession("s", "alice", "base", None, adapter="inflight:run", run_id="run")
    state.add_session(session)
    state.add_inflight("run", "inflight:run")
    assert state.session("alice", "s") == session
    assert state.drop_run("run") == ["inflight:run"]
    with pytest.raises(ResourceNotFoundError):
        state.session("alice", "s")


def test_checkpoint_adapters_load_once_until_forgotten():
    state = TinkerState()
    assert state.mark_loaded("ckpt") and not state.mark_loaded("ckpt")
    state.forget_loaded("ckpt")
    assert state.mark_loaded("ckpt")
