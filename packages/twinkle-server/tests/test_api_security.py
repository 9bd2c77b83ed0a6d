"""Every request is authenticated; tenants never see each other's things; quotas and paths are enforced."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.server.application import create_app
from twinkle.server.auth import issue_api_key
from twinkle.server.config import Quotas, ServerConfig, UserConfig
from twinkle.server.store import SQLiteStore

API = "/twinkle/v1"
FEATURE = make_input_feature(list(range(5, 15)), [IGNORE_INDEX] * 5 + list(range(10, 15)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("server")
    config = ServerConfig(
        state_dir=state_dir,
        max_loras=4,
        users={
            "carol": UserConfig(quotas={"max_adapters": 1, "max_rank": 8, "max_tokens_per_request": 12}),
            "dave": UserConfig(quotas={"requests_per_second": 1.0}),
        },
        quotas=Quotas(requests_per_second=1000.0),
    )
    store = SQLiteStore(config.database)
    keys = {}
    for user in ("alice", "bob", "carol", "dave"):
        if store.get_user(user) is None:
            store.add_user(user)
        keys[user] = issue_api_key(store, user)
    with TestClient(create_app(config, store), raise_server_exceptions=False) as client:
        yield client, keys, config


@pytest.fixture(scope="module")
def alice_run(server):
    """One run of alice's shared by the tests below (her max_adapters quota is 4)."""
    client, keys, _ = server
    return _run(client, keys, "alice", target_modules=["v_proj", "o_proj"]).json()["run_id"]


def _headers(keys, user):
    return {"Authorization": f"Bearer {keys[user]}"}


def _run(client, keys, user, **lora):
    headers = _headers(keys, user)
    session = client.post(f"{API}/sessions", headers=headers, json={}).json()["session_id"]
    response = client.post(
        f"{API}/runs", headers=headers, json={"session_id": session, "lora_config": {"r": 4, **lora}}
    )
    return response


def _wait(client, headers, future_id):
    while True:
        reply = client.get(f"{API}/futures/{future_id}", params={"wait": 30}, headers=headers).json()
        if reply["status"] != "pending":
            return reply


def _call(client, headers, run_id, method, **kwargs):
    return client.post(f"{API}/runs/{run_id}/call", headers=headers, json={"method": method, "kwargs": kwargs})


def test_requests_without_a_valid_key_are_401(server):
    client, keys, _ = server
    for headers in (
        {},
        {"Authorization": "Bearer tml-wrong"},
        {"X-API-Key": "tml-wrong"},
        {"Authorization": "Basic x"},
    ):
        response = client.get(f"{API}/runs", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "AuthenticationError"
    assert client.get(f"{API}/runs", headers={"X-API-Key": keys["alice"]}).status_code == 200
    assert client.get("/healthz").json() == {"status": "ok"}


def test_another_tenants_run_checkpoint_and_future_are_not_found(server):
    client, keys, _ = server
    alice, bob = _headers(keys, "alice"), _headers(keys, "bob")
    run_id = _run(client, keys, "alice", target_modules=["q_proj"]).json()["run_id"]
    assert _call(client, alice, run_id, "set_optimizer", optimizer_cls="AdamW", lr=1e-3).status_code == 200
    future = _call(client, alice, run_id, "forward_backward", inputs=[FEATURE]).json()["future_id"]
    assert _wait(client, alice, future)["status"] == "done"
    saved = _wait(client, alice, _call(client, alice, run_id, "save", name="mine").json()["future_id"])
    assert saved == {"status": "done", "result": f"twinkle://{run_id}/mine"}

    bob_run = _run(client, keys, "bob", target_modules=["q_proj"]).json()["run_id"]
    attempts = [
        client.get(f"{API}/runs/{run_id}", headers=bob),
        client.get(f"{API}/runs/{run_id}/checkpoints", headers=bob),
        client.delete(f"{API}/runs/{run_id}/checkpoints/mine", headers=bob),
        _call(client, bob, run_id, "forward_only", inputs=[FEATURE]),
        client.get(f"{API}/futures/{future}", headers=bob),
        client.post(f"{API}/sample", headers=bob, json={"run_id": run_id, "inputs": [{"input_ids": [1, 2]}]}),
    ]
    assert [response.status_code for response in attempts] == [404] * len(attempts)
    load = _call(client, bob, bob_run, "load", path=f"twinkle://{run_id}/mine")
    assert load.status_code == 404 and load.json()["error"]["type"] == "ResourceNotFoundError"
    assert run_id not in {run["run_id"] for run in client.get(f"{API}/runs", headers=bob).json()["runs"]}
    listing = client.get(f"{API}/runs/{run_id}/checkpoints", headers=alice).json()["checkpoints"]
    assert [c["name"] for c in listing] == ["mine"] and listing[0]["path"] == f"twinkle://{run_id}/mine"


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", ".hidden", "nul\x00byte", ""])
def test_checkpoint_names_cannot_escape_the_storage_folder(server, alice_run, name):
    client, keys, config = server
    headers, run_id = _headers(keys, "alice"), alice_run
    response = _call(client, headers, run_id, "save", name=name)
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["type"] == "InvalidInputError"
    for method, kwargs in (("load", {"path": "twinkle://../../etc"}), ("save", {"name": "x", "output_dir": "/tmp"})):
        response = _call(client, headers, run_id, method, **kwargs)
        assert (
            response.status_code in (400, 404)
            or _wait(client, headers, response.json()["future_id"])["status"] == "failed"
        )
    assert not any(p.name == "escape" for p in config.state_dir.parent.iterdir())


def test_components_are_registered_names_and_datasets_hub_ids(server, alice_run):
    client, keys, _ = server
    headers, run_id = _headers(keys, "alice"), alice_run
    for method, kwargs in (
        ("set_loss", {"loss": "os:system"}),
        ("set_optimizer", {"optimizer_cls": "subprocess.Popen"}),
        ("set_template", {"template": "builtins:eval"}),
    ):
        response = _call(client, headers, run_id, method, **kwargs)
        assert response.status_code == 400 and "registered name" in response.json()["error"]["message"]
    response = client.post(f"{API}/datasets", headers=headers, json={"dataset_id": "/etc/passwd"})
    assert response.status_code == 403 and "hub id" in response.json()["error"]["message"]
    response = client.post(f"{API}/runs/{run_id}/call", headers=headers, json={"method": "__init__", "kwargs": {}})
    assert response.status_code == 400 and "unknown method" in response.json()["error"]["message"]


def test_quotas_answer_with_the_limit_that_was_hit(server):
    client, keys, _ = server
    too_big = _run(client, keys, "carol", r=16, target_modules=["q_proj"])
    assert too_big.status_code == 403 and too_big.json()["error"]["limit"] == "max_rank"
    run_id = _run(client, keys, "carol", target_modules=["q_proj"]).json()["run_id"]
    second = _run(client, keys, "carol", target_modules=["q_proj"])
    assert second.status_code == 403 and second.json()["error"]["limit"] == "max_adapters"
    long_batch = _call(client, _headers(keys, "carol"), run_id, "forward_only", inputs=[FEATURE, FEATURE])
    assert long_batch.status_code == 403 and long_batch.json()["error"]["limit"] == "max_tokens_per_request"
    # A sampling request counts what it may generate: (4 prompt tokens + max_tokens) per sample.
    for sampling_params, num_samples, tokens in (({"max_tokens": 9}, None, 13), ({"max_tokens": 4}, 2, 16)):
        body = {"inputs": [{"input_ids": [5, 6, 7, 8]}], "sampling_params": sampling_params, "num_samples": num_samples}
        refused = client.post(f"{API}/sample", headers=_headers(keys, "carol"), json=body)
        assert refused.status_code == 403, refused.text
        assert f"request has {tokens} tokens" in refused.json()["error"]["message"]
    statuses = [client.get(f"{API}/runs", headers=_headers(keys, "dave")).status_code for _ in range(5)]
    assert 429 in statuses and statuses[0] == 200


def test_malformed_bodies_are_4xx_and_the_server_keeps_serving(server, alice_run):
    client, keys, _ = server
    headers, run_id = _headers(keys, "alice"), alice_run
    assert client.post(f"{API}/runs/{run_id}/call", headers=headers, content=b"{not json").status_code == 422
    assert client.post(f"{API}/runs/{run_id}/call", headers=headers, json=[1, 2]).status_code == 422
    for bad in ({"input_ids": [1.5, 2.5], "labels": [1, 2]}, {"input_ids": [1, 2] * 30000}, {"input_ids": [10**9]}):
        response = _call(client, headers, run_id, "forward_only", inputs=[bad])
        assert response.status_code == 400 and "inputs[0]" in response.json()["error"]["message"]
    assert client.get("/healthz").status_code == 200
