import httpx
import numpy as np
import pytest

from twinkle import wire
from twinkle.errors import (
    AuthenticationError,
    ConfigurationError,
    InvalidInputError,
    PermissionDeniedError,
    QuotaExceededError,
    RateLimitError,
    ResourceNotFoundError,
    ServerError,
)
from twinkle_client import TwinkleClient
from twinkle_client import http as client_http


@pytest.fixture
def sleeps(monkeypatch):
    """Back-off delays, recorded instead of slept."""
    delays: list[float] = []
    monkeypatch.setattr(client_http.time, "sleep", delays.append)
    return delays


def test_base_url_gets_the_api_prefix_once():
    assert TwinkleClient("http://h:1/").base_url == "http://h:1/twinkle/v1"
    assert TwinkleClient("http://h:1/twinkle/v1").base_url == "http://h:1/twinkle/v1"


def test_bodies_go_out_wire_encoded_with_the_key_and_replies_decode_from_wire_or_json(client, server):
    logps = np.array([[-0.5, np.nan]], dtype=np.float32)
    server.script("POST", "/echo", {"got": logps}, server.json_reply({"plain": [1, 2]}))
    reply = client.request("POST", "/echo", {"logps": logps, "ids": list(range(10))})
    np.testing.assert_array_equal(reply["got"], logps)
    assert client.request("POST", "/echo", {}) == {"plain": [1, 2]}
    sent = server.requests("POST", "/echo")[0]
    assert sent.headers["content-type"] == wire.CONTENT_TYPE
    assert sent.headers["authorization"] == "Bearer key-1"
    np.testing.assert_array_equal(sent.body["logps"], logps)
    assert sent.body["ids"] == list(range(10))


def test_a_post_without_idempotency_key_is_never_retried(client, server, sleeps):
    server.script("POST", "/runs", server.error(503, "ServerError", "busy"), httpx.ReadTimeout("slow"))
    with pytest.raises(ServerError, match="busy"):
        client.create_run({"r": 8})
    with pytest.raises(ServerError, match="failed after the request was sent"):
        client.create_run({"r": 8})
    assert len(server.requests("POST", "/runs")) == 2
    assert sleeps == []


def test_requests_that_never_reached_the_server_are_retried(client, server, sleeps):
    server.script("POST", "/runs", httpx.ConnectError("refused"), httpx.ConnectTimeout("slow"), {"run_id": "r9"})
    assert client.create_run({"r": 8}) == "r9"
    assert len(server.requests("POST", "/runs")) == 3
    assert len(sleeps) == 2


def test_an_unreachable_server_gives_up_after_max_retries(server, sleeps):
    server.script("GET", "/server_info", *[httpx.ConnectError("refused")] * 3)
    client = TwinkleClient("http://twinkle.test", transport=httpx.MockTransport(server), max_retries=2)
    with pytest.raises(ServerError, match=r"cannot reach the Twinkle server at http://twinkle.test/twinkle/v1"):
        client.server_info()
    assert sleeps == [0.5, 1.0]  # exponential back-off
    client.close()


def test_a_call_carries_an_idempotency_key_and_its_retries_reuse_it(client, server, sleeps):
    run_id = client.create_run({"r": 8})
    path = f"/runs/{run_id}/call"
    server.script("POST", path, server.error(503, "ServerError", "busy"), httpx.ReadTimeout("slow"))
    assert client.call(run_id, "zero_grad") is None
    client.call(run_id, "zero_grad")
    keys = [seen.body["idempotency_key"] for seen in server.requests("POST", path)]
    assert len(keys) == 4
    assert keys[0] == keys[1] == keys[2] != keys[3]
    assert len(keys[0]) == 32


def test_gets_are_retried_on_busy_replies_honouring_retry_after(client, server, sleeps):
    busy = httpx.Response(429, headers={"retry-after": "2"}, json={"error": {"type": "RateLimitError", "message": "x"}})
    server.script("GET", "/runs", busy, server.error(502, "ServerError", "proxy"), {"runs": [{"run_id": "r1"}]})
    assert client.list_runs() == [{"run_id": "r1"}]
    assert sleeps == [2.0, 0.0]


@pytest.mark.parametrize(
    ("status", "type_name", "expected"),
    [
        (400, "InvalidInputError", InvalidInputError),
        (401, "AuthenticationError", AuthenticationError),
        (403, "PermissionDeniedError", PermissionDeniedError),
        (404, "ResourceNotFoundError", ResourceNotFoundError),
        (409, "ConfigurationError", ConfigurationError),
        (429, "RateLimitError", RateLimitError),
    ],
)
def test_error_replies_raise_the_class_the_server_named(client, server, status, type_name, expected):
    server.script("DELETE", "/runs/r1/checkpoints/c1", server.error(status, type_name, f"{type_name} for c1"))
    with pytest.raises(expected) as caught:
        client.delete_checkpoint("r1", "c1")
    assert str(caught.value) == f"{type_name} for c1"
    assert caught.value.status_code == status


def test_error_extras_become_attributes_and_unknown_types_fall_back_to_server_error(client, server):
    server.script(
        "GET",
        "/runs",
        server.error(403, "QuotaExceededError", "at most 2 adapters", limit="max_adapters"),
        server.error(500, "KeyError", "'lr'"),
        server.error(500, "os", "not an error class"),
    )
    server.script("POST", "/runs", httpx.Response(502, text="<html>Bad Gateway</html>"))
    with pytest.raises(QuotaExceededError) as quota:
        client.list_runs()
    assert (str(quota.value), quota.value.limit, quota.value.status_code) == ("at most 2 adapters", "max_adapters", 403)
    with pytest.raises(ServerError, match=r"^KeyError: 'lr'$"):
        client.list_runs()
    with pytest.raises(ServerError, match=r"^os: not an error class$"):
        client.list_runs()
    with pytest.raises(ServerError, match=r"HTTP 502 from POST .*/runs: '<html>Bad Gateway</html>'") as gateway:
        client.create_run({"r": 8})
    assert gateway.value.status_code == 502


def test_long_methods_long_poll_their_future_until_done(client, server, sleeps):
    server.pending_polls = 2
    run_id = client.create_run({"r": 8})
    result = client.call(run_id, "forward_backward", inputs=[{"input_ids": [1, 2]}])
    assert result["loss"] == 1.25
    polls = server.requests("GET", "/futures/f1")
    assert len(polls) == 3
    assert all(poll.params == {"wait": "30"} for poll in polls)


def test_a_failed_future_raises_the_recorded_error(client, server):
    server.script("POST", "/runs/r1/call", {"future_id": "f9"})
    failure = {"status": "failed", "error": {"type": "InvalidInputError", "message": "inputs[0].input_ids is empty"}}
    server.script("GET", "/futures/f9", failure)
    with pytest.raises(InvalidInputError, match=r"inputs\[0\].input_ids is empty") as caught:
        client.call("r1", "forward_backward", inputs=[{"input_ids": []}])
    assert caught.value.status_code is None


def test_short_methods_answer_directly(client, server):
    run_id = client.create_run({"r": 8})
    assert client.call(run_id, "calculate_metric", is_training=True) == {"loss": 1.25}
    assert server.requests("GET", "/futures/f1") == []


def test_unreadable_replies_are_server_errors(client, server):
    server.script("GET", "/runs", httpx.Response(200, text="<html>", headers={"content-type": "text/html"}))
    with pytest.raises(ServerError, match="unreadable reply"):
        client.list_runs()
    server.script("POST", "/runs/r1/call", {"neither": 1})
    with pytest.raises(ServerError, match="expected a result or a future_id"):
        client.call("r1", "zero_grad")


def test_a_long_method_done_within_the_servers_wait_takes_one_request(client, server):
    server.script("POST", "/runs/r1/call", {"result": {"loss": 0.5}})
    assert client.call("r1", "forward_backward", inputs=[{"input_ids": [1, 2]}]) == {"loss": 0.5}
    (post,) = server.requests("POST", "/runs/r1/call")
    assert post.params == {"wait": "30"}
    assert [seen for seen in server.seen if seen.method == "GET"] == []
