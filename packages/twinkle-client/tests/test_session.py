import threading
import time

import httpx
import pytest

from twinkle.errors import AuthenticationError, ConfigurationError
from twinkle_client import TwinkleClient, context, get_client, init_twinkle_client


def heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "twinkle-heartbeat"]


def wait_for(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_session_heartbeat_runs_until_close_which_ends_the_session(server):
    client = TwinkleClient("http://twinkle.test", transport=httpx.MockTransport(server), heartbeat_interval=0.02)
    assert client.session_id == "s1"
    assert client.session_id == "s1"  # opened once
    assert len(server.requests("POST", "/sessions")) == 1
    assert wait_for(lambda: len(server.requests("POST", "/sessions/s1/heartbeat")) >= 2)
    [thread] = heartbeat_threads()
    assert thread.daemon
    client.close()
    assert not thread.is_alive()
    beats = len(server.requests("POST", "/sessions/s1/heartbeat"))
    time.sleep(0.1)
    assert len(server.requests("POST", "/sessions/s1/heartbeat")) == beats
    assert len(server.requests("DELETE", "/sessions/s1")) == 1
    client.close()  # a second close does nothing
    assert len(server.requests("DELETE", "/sessions/s1")) == 1


def test_a_failed_heartbeat_is_logged_and_the_next_one_still_runs(server, caplog):
    server.script("POST", "/sessions/s1/heartbeat", server.error(500, "ServerError", "store locked"))
    with TwinkleClient("http://twinkle.test", transport=httpx.MockTransport(server), heartbeat_interval=0.02) as client:
        client.open_session()
        assert wait_for(lambda: len(server.requests("POST", "/sessions/s1/heartbeat")) >= 2)
    assert heartbeat_threads() == []
    assert "session heartbeat failed: store locked" in caplog.text


def test_a_client_that_never_opened_a_session_closes_without_calls(server):
    with TwinkleClient("http://twinkle.test", transport=httpx.MockTransport(server)) as client:
        assert client.server_info()["base_model"] == "builtin://qwen3-tiny"
    assert [(s.method, s.path) for s in server.seen] == [("GET", "/server_info")]


def test_init_reads_the_environment_opens_the_session_and_replaces_the_previous_client(server, monkeypatch):
    monkeypatch.setattr(context, "_client", None)
    monkeypatch.setenv("TWINKLE_BASE_URL", "http://from-env:9000")
    monkeypatch.setenv("TWINKLE_API_KEY", "env-key")
    first = init_twinkle_client(transport=httpx.MockTransport(server), heartbeat_interval=3600)
    assert first.base_url == "http://from-env:9000/twinkle/v1"
    assert server.seen[0].headers["authorization"] == "Bearer env-key"
    assert get_client() is first
    second = init_twinkle_client("http://other", "k2", transport=httpx.MockTransport(server), heartbeat_interval=3600)
    assert get_client() is second
    assert len(server.requests("DELETE", "/sessions/s1")) == 1  # the first client was closed
    second.close()


def test_a_wrong_key_fails_at_init(server, monkeypatch):
    monkeypatch.setattr(context, "_client", None)
    server.script("POST", "/sessions", server.error(401, "AuthenticationError", "unknown API key"))
    with pytest.raises(AuthenticationError, match="unknown API key"):
        init_twinkle_client("http://twinkle.test", "bad", transport=httpx.MockTransport(server))
    with pytest.raises(ConfigurationError, match=r"call twinkle_client\.init_twinkle_client"):
        get_client()
