"""The Tinker routes at the HTTP level: what the SDK never sends but a broken or hostile client may.

Each answer must be one the SDK handles as meant: 4xx it does not retry for a
bad request (never 409), a JSON ``try_again`` for a future still running, 410
for a heartbeat on a closed session, and the same ``request_id`` for a retried
``(model, seq_id)``.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from twinkle.server.application import create_app
from twinkle.server.auth import issue_api_key
from twinkle.server.config import Quotas, ServerConfig
from twinkle.server.store import SQLiteStore

API = "/api/v1"


NEW_SESSION = {"tags": [], "user_metadata": {}, "sdk_version": tinker.__version__}  # what the SDK sends


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = ServerConfig(state_dir=tmp_path_factory.mktemp("tinker-http"), quotas=Quotas(requests_per_second=1000.0))
    store = SQLiteStore(config.database)
    headers = {}
    for user in ("ann", "ben"):
        store.add_user(user)
        headers[user] = {"X-API-Key": issue_api_key(store, user)}
    with TestClient(create_app(config, store), raise_server_exceptions=False) as client:
        yield client, headers


def _model(client, headers) -> str:
    session = client.post(f"{API}/create_session", headers=headers, json=NEW_SESSION).json()
    body = {
        "session_id": session["session_id"],
        "model_seq_id": 0,
        "base_model": "builtin://qwen3-tiny",
        "lora_config": {"rank": 2, "seed": 0},
    }
    future = client.post(f"{API}/create_model", headers=headers, json=body).json()
    assert _result(client, headers, future["request_id"]).json()["model_id"] == future["model_id"]
    return future["model_id"]


def _result(client, headers, request_id):
    while True:
        reply = client.post(f"{API}/retrieve_future", headers=headers, json={"request_id": request_id})
        if reply.headers["content-type"].startswith("application/json") and reply.json().get("type") == "try_again":
            continue
        return reply


def _fwdbwd_body(model_id: str, seq_id: int, loss_fn: str = "cross_entropy") -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, dtype=np.float32)},
    )
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn=loss_fn),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _post_proto(client, headers, body: bytes):
    return client.post(
        f"{API}/forward_backward", headers={**headers, "Content-Type": "application/x-protobuf"}, content=body
    )


def test_a_retried_seq_id_gets_the_first_request_id_and_runs_once(server):
    client, headers = server
    model = _model(client, headers["ann"])
    first = _post_proto(client, headers["ann"], _fwdbwd_body(model, 1)).json()
    again = _post_proto(client, headers["ann"], _fwdbwd_body(model, 1)).json()
    assert again["request_id"] == first["request_id"]
    reply = _result(client, headers["ann"], first["request_id"])
    assert reply.headers["content-type"] == "application/x-protobuf"
    # polling again (a lost response) returns the same bytes
    assert _result(client, headers["ann"], first["request_id"]).content == reply.content


def test_a_refused_request_frees_its_turn_for_the_next_one(server):
    client, headers = server
    model = _model(client, headers["ann"])
    refused = _post_proto(client, headers["ann"], _fwdbwd_body(model, 1, loss_fn="nope"))
    assert refused.status_code == 400 and "nope" in refused.json()["detail"]
    later = _post_proto(client, headers["ann"], _fwdbwd_body(model, 2)).json()
    assert _result(client, headers["ann"], later["request_id"]).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/forward_backward", b"\xff\x00not-protobuf", 400),
        (
            "/create_model",
            {"session_id": "nope", "model_seq_id": 0, "base_model": "builtin://qwen3-tiny", "lora_config": {"rank": 2}},
            404,
        ),
        ("/create_model", {"session_id": "x"}, 400),
        ("/optim_step", {"model_id": "nope", "seq_id": 1, "adam_params": {}}, 404),
        ("/retrieve_future", {"request_id": "fut-unknown"}, 404),
        ("/weights_info", {"tinker_path": "s3://bucket/x"}, 400),
    ],
)
def test_bad_requests_get_a_status_the_sdk_does_not_retry(server, path, body, status):
    client, headers = server
    if isinstance(body, bytes):
        reply = client.post(
            API + path, headers={**headers["ann"], "Content-Type": "application/x-protobuf"}, content=body
        )
    else:
        reply = client.post(API + path, headers=headers["ann"], json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["detail"]


def test_another_users_model_and_future_do_not_exist_for_them(server):
    client, headers = server
    model = _model(client, headers["ann"])
    future = _post_proto(client, headers["ann"], _fwdbwd_body(model, 1)).json()["request_id"]
    assert _post_proto(client, headers["ben"], _fwdbwd_body(model, 2)).status_code == 404
    reply = client.post(f"{API}/retrieve_future", headers=headers["ben"], json={"request_id": future})
    assert reply.status_code == 404
    assert client.post(f"{API}/get_info", headers=headers["ben"], json={"model_id": model}).status_code == 404


def test_sessions_heartbeat_finish_and_telemetry(server):
    client, headers = server
    session = client.post(f"{API}/create_session", headers=headers["ann"], json=NEW_SESSION).json()["session_id"]
    beat = {"session_id": session, "type": "session_heartbeat"}
    assert client.post(f"{API}/session_heartbeat", headers=headers["ann"], json=beat).status_code == 200
    finish = {"reason": {"type": "success"}, "detail": None}
    assert client.post(f"{API}/sessions/{session}/finish", headers=headers["ann"], json=finish).status_code == 200
    assert client.post(f"{API}/session_heartbeat", headers=headers["ann"], json=beat).status_code == 410
    events = {"events": [], "platform": "linux", "sdk_version": tinker.__version__, "session_id": session}
    events["process_uuid"] = "3f2b0c9e-0000-4000-8000-000000000000"
    telemetry = client.post(f"{API}/telemetry", headers=headers["ann"], json=events)
    assert telemetry.json() == {"status": "accepted"}
    assert client.post(f"{API}/client/config", headers={"X-API-Key": "tml-wrong-key-0123456789"}).status_code == 401


def test_native_and_tinker_futures_are_polled_at_their_own_endpoints(server):
    client, headers = server
    model = _model(client, headers["ann"])
    future = _post_proto(client, headers["ann"], _fwdbwd_body(model, 1)).json()["request_id"]
    reply = client.get(f"/twinkle/v1/futures/{future}", headers=headers["ann"])
    assert reply.status_code == 400 and "retrieve_future" in reply.json()["error"]["message"]
