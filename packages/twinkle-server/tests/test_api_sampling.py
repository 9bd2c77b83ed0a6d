"""Native sample calls of several tenants in flight at once are generated together, each as it samples alone."""

from __future__ import annotations

import re

import torch
from fastapi.testclient import TestClient

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.server.application import create_app
from twinkle.server.auth import issue_api_key
from twinkle.server.config import Quotas, ServerConfig
from twinkle.server.store import SQLiteStore

API = "/twinkle/v1"
GREEDY = {"max_tokens": 6, "temperature": 0.0, "logprobs": True}


def _start(state_dir):
    config = ServerConfig(state_dir=state_dir, quotas=Quotas(requests_per_second=1000.0))
    store = SQLiteStore(config.database)
    keys = {}
    for user in ("ann", "ben"):
        store.add_user(user)
        keys[user] = {"X-API-Key": issue_api_key(store, user)}
    return TestClient(create_app(config, store), raise_server_exceptions=False), keys


def _wait(client, headers, future_id):
    while True:
        reply = client.get(f"{API}/futures/{future_id}", params={"wait": 30}, headers=headers).json()
        if reply["status"] != "pending":
            assert reply["status"] == "done", reply
            return reply["result"]


def _trained_run(client, headers, seed):
    """A run whose adapter took one step (so it samples differently from the base model)."""
    session = client.post(f"{API}/sessions", headers=headers, json={}).json()["session_id"]
    body = {"session_id": session, "lora_config": {"r": 4, "target_modules": "all-linear"}, "seed": seed}
    run_id = client.post(f"{API}/runs", headers=headers, json=body).json()["run_id"]
    ids = torch.randint(0, 5000, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    for method, kwargs in (
        ("set_optimizer", {"optimizer_cls": "AdamW", "lr": 5e-2}),
        ("forward_backward", {"inputs": [make_input_feature(ids, [IGNORE_INDEX] * 4 + ids[4:])]}),
        ("clip_grad_and_step", {}),
    ):
        reply = client.post(f"{API}/runs/{run_id}/call", headers=headers, json={"method": method, "kwargs": kwargs})
        body = reply.json()
        if "future_id" in body:
            _wait(client, headers, body["future_id"])
    return run_id


def _sample_batches(client) -> tuple[float, float]:
    text = client.get("/metrics").text
    count, total = (
        re.search(rf"^twinkle_sample_batch_requests_{name} (\S+)$", text, re.M) for name in ("count", "sum")
    )
    assert count is not None and total is not None
    return float(count[1]), float(total[1])


def test_tenants_samples_in_flight_together_are_one_batch_each_as_if_alone(tmp_path):
    client, keys = _start(tmp_path)
    with client:
        runs = {user: _trained_run(client, keys[user], seed) for seed, user in enumerate(keys)}
        prompts = [[{"input_ids": [151644, 872, 198, 9707 + index]}] for index in range(4)]
        requests = [  # each tenant's run twice, and the base model
            ("ann", {"run_id": runs["ann"], "inputs": prompts[0]}),
            ("ben", {"run_id": runs["ben"], "inputs": prompts[0]}),
            ("ann", {"inputs": prompts[1]}),
            ("ben", {"run_id": runs["ben"], "inputs": prompts[2], "num_samples": 2}),
            ("ann", {"run_id": runs["ann"], "inputs": prompts[3]}),
        ]
        before = _sample_batches(client)
        busy = client.post(  # keeps the worker busy while the samples queue
            f"{API}/runs/{runs['ann']}/call",
            headers=keys["ann"],
            json={"method": "forward_only", "kwargs": {"inputs": [{"input_ids": list(range(1, 400))}] * 4}},
        ).json()
        futures = [
            client.post(f"{API}/sample", headers=keys[user], json={**body, "sampling_params": GREEDY}).json()
            for user, body in requests
        ]
        together = [_wait(client, keys[user], f["future_id"]) for (user, _), f in zip(requests, futures, strict=True)]
        if "future_id" in busy:
            _wait(client, keys["ann"], busy["future_id"])
        batches, calls = (after - first for after, first in zip(_sample_batches(client), before, strict=True))
        assert calls == len(requests) and batches < calls, (batches, calls)
        for (user, body), response in zip(requests, together, strict=True):
            future = client.post(f"{API}/sample", headers=keys[user], json={**body, "sampling_params": GREEDY}).json()
            alone = _wait(client, keys[user], future["future_id"])
            assert [s["tokens"] for s in response["sequences"]] == [s["tokens"] for s in alone["sequences"]]
            for ours, theirs in zip(response["sequences"], alone["sequences"], strict=True):
                assert max(abs(a - b) for a, b in zip(ours["logprobs"], theirs["logprobs"], strict=True)) <= 1e-4
        by_weights = [together[0]["sequences"][0]["logprobs"], together[1]["sequences"][0]["logprobs"]]
        assert by_weights[0] != by_weights[1], "each tenant's samples come from its own adapter"
