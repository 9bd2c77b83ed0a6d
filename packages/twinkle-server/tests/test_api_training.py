"""Training (and sampling) through the server equals doing it in-process, across tenants batched together and
restarts."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from fastapi.testclient import TestClient
from peft import LoraConfig

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.model import MultiLoraModel
from twinkle.server.application import create_app
from twinkle.server.auth import issue_api_key
from twinkle.server.config import Quotas, ServerConfig
from twinkle.server.store import SQLiteStore

API = "/twinkle/v1"
TENANTS = {"ann": {"r": 2, "target_modules": ["q_proj", "v_proj"]}, "ben": {"r": 8, "target_modules": "all-linear"}}
STEPS = 3


def _features(seed: int, count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    features = []
    for length in range(8, 8 + count):
        ids = torch.randint(0, 5000, (length,), generator=generator).tolist()
        features.append(make_input_feature(ids, [IGNORE_INDEX] * 4 + ids[4:]))
    return features


def _start(state_dir, users=tuple(TENANTS)):
    config = ServerConfig(state_dir=state_dir, quotas=Quotas(requests_per_second=1000.0))
    store = SQLiteStore(config.database)
    keys = {}
    for user in users:
        if store.get_user(user) is None:
            store.add_user(user)
        keys[user] = {"X-API-Key": issue_api_key(store, user)}
    return TestClient(create_app(config, store), raise_server_exceptions=False), keys


def _wait(client, headers, future_id):
    while True:
        reply = client.get(f"{API}/futures/{future_id}", params={"wait": 30}, headers=headers).json()
        if reply["status"] != "pending":
            assert reply["status"] == "done", reply
            return reply["result"]


def _call(client, headers, run_id, method, **kwargs):
    reply = client.post(f"{API}/runs/{run_id}/call", headers=headers, json={"method": method, "kwargs": kwargs})
    assert reply.status_code == 200, reply.json()
    body = reply.json()
    return _wait(client, headers, body["future_id"]) if "future_id" in body else body["result"]


def _new_run(client, headers, user="ann"):
    """A run of ``user``'s adapter (:data:`TENANTS`) in a new session."""
    session = client.post(f"{API}/sessions", headers=headers, json={}).json()["session_id"]
    body = {"session_id": session, "lora_config": TENANTS[user], "seed": 7}
    return client.post(f"{API}/runs", headers=headers, json=body).json()["run_id"]


def _train_remotely(client, headers, user, losses):
    run_id = _new_run(client, headers, user)
    _call(client, headers, run_id, "set_optimizer", optimizer_cls="AdamW", lr=1e-2)
    for step in range(STEPS):
        output = _call(client, headers, run_id, "forward_backward", inputs=_features(step, 3 if user == "ann" else 2))
        losses.append(output["loss"])
        _call(client, headers, run_id, "clip_grad_and_step")
    _call(client, headers, run_id, "save", name="final")
    return run_id


def _train_in_process(user):
    model = MultiLoraModel(device="cpu")
    model.add_adapter_to_model(user, LoraConfig(**TENANTS[user]), seed=7)
    model.set_optimizer("AdamW", adapter_name=user, lr=1e-2)
    losses = []
    for step in range(STEPS):
        losses.append(model.forward_backward(_features(step, 3 if user == "ann" else 2), adapter_name=user).loss)
        model.clip_grad_and_step(adapter_name=user)
    return losses, model.lora_payload(user)[1]


def test_concurrent_tenants_train_exactly_as_they_would_alone(tmp_path):
    client, keys = _start(tmp_path)
    with client:
        losses = {user: [] for user in TENANTS}
        runs = {}
        threads = [
            threading.Thread(target=lambda u=user: runs.__setitem__(u, _train_remotely(client, keys[u], u, losses[u])))
            for user in TENANTS
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        metrics = client.get("/metrics").text
    assert "twinkle_shared_pass_requests_count" in metrics
    for user, run_id in runs.items():
        expected_losses, expected_weights = _train_in_process(user)
        assert losses[user] == pytest.approx(expected_losses, abs=1e-5)
        from safetensors.torch import load_file

        saved = load_file(str(tmp_path / "checkpoints" / user / run_id / "final" / "adapter_model.safetensors"))
        for key, tensor in expected_weights.items():
            torch.testing.assert_close(saved[key], tensor.detach(), atol=1e-5, rtol=1e-5)


def test_after_a_restart_runs_and_checkpoints_are_listed_and_resume(tmp_path):
    feature = _features(99, 2)
    client, keys = _start(tmp_path, ("ann",))
    headers = keys["ann"]
    with client:
        run_id = _train_remotely(client, headers, "ann", [])
        before = _call(client, headers, run_id, "forward_only", inputs=feature)["loss"]
        pending, _ = client.app.state.server.store.create_future("ann", "forward_backward", run_id=run_id)

    client, keys = _start(tmp_path, ("ann",))
    headers = keys["ann"]
    with client:
        (run,) = client.get(f"{API}/runs", headers=headers).json()["runs"]
        assert run["run_id"] == run_id and run["resident"] is False
        assert [c["name"] for c in run["checkpoints"]] == ["final"]
        lost = client.get(f"{API}/futures/{pending.id}", headers=headers).json()
        assert lost["status"] == "failed" and "restarted" in lost["error"]["message"]
        body = {"method": "forward_only", "kwargs": {"inputs": feature}}
        reply = client.post(f"{API}/runs/{run_id}/call", headers=headers, json=body)
        assert reply.status_code == 409 and "resume it first" in reply.json()["error"]["message"]

        session = client.post(f"{API}/sessions", headers=headers, json={}).json()["session_id"]
        assert (
            client.post(f"{API}/runs/{run_id}/resume", headers=headers, json={"session_id": session}).status_code == 200
        )
        _call(client, headers, run_id, "load", path=f"twinkle://{run_id}/final")
        assert _call(client, headers, run_id, "forward_only", inputs=feature)["loss"] == pytest.approx(before, abs=1e-6)


def test_closing_a_session_frees_its_adapters_and_keeps_checkpoints(tmp_path):
    client, keys = _start(tmp_path, ("ann",))
    headers = keys["ann"]
    with client:
        run_id = _train_remotely(client, headers, "ann", [])
        pool = client.app.state.server.engine.pool
        assert run_id in pool.model.adapter_names
        session = client.get(f"{API}/runs/{run_id}", headers=headers).json()
        sessions = client.app.state.server.store.list_runs("ann")[0].session_id
        assert client.delete(f"{API}/sessions/{sessions}", headers=headers).status_code == 200
        assert run_id not in pool.model.adapter_names and session["checkpoints"]
        assert client.get(f"{API}/runs/{run_id}/checkpoints", headers=headers).json()["checkpoints"]


def test_a_session_without_heartbeats_expires_and_its_adapters_leave_the_pool(tmp_path):
    import time

    config = ServerConfig(state_dir=tmp_path, session_timeout_s=3.0, quotas=Quotas(requests_per_second=1000.0))
    store = SQLiteStore(config.database)
    store.add_user("ann")
    headers = {"X-API-Key": issue_api_key(store, "ann")}
    with TestClient(create_app(config, store), raise_server_exceptions=False) as client:
        alive = client.post(f"{API}/sessions", headers=headers, json={}).json()["session_id"]
        lapsed = client.post(f"{API}/sessions", headers=headers, json={}).json()["session_id"]
        runs = {}
        for session in (alive, lapsed):
            reply = client.post(f"{API}/runs", headers=headers, json={"session_id": session, "lora_config": {"r": 2}})
            assert reply.status_code == 200, reply.json()
            runs[session] = reply.json()["run_id"]
        pool = client.app.state.server.engine.pool
        deadline = time.monotonic() + 8
        while runs[lapsed] in pool.model.adapter_names and time.monotonic() < deadline:
            assert client.post(f"{API}/sessions/{alive}/heartbeat", headers=headers).status_code == 200
            time.sleep(0.5)
        assert runs[lapsed] not in pool.model.adapter_names
        assert runs[alive] in pool.model.adapter_names
        reply = client.post(f"{API}/sessions/{lapsed}/heartbeat", headers=headers)
        assert reply.status_code == 404 and "expired" in reply.json()["error"]["message"]


def test_a_call_spelling_out_the_default_micro_batch_size_still_joins_shared_passes(tmp_path):
    """``twinkle_client`` sends ``micro_batch_size=None``; that must not keep its tenant out of batching."""
    client, keys = _start(tmp_path, ("ann",))
    headers = keys["ann"]
    with client:
        run_id = _new_run(client, headers)
        _call(client, headers, run_id, "forward_backward", inputs=_features(0, 2), micro_batch_size=None)
        passes = client.app.state.server.telemetry.pass_requests.collect()[0].samples
    assert any(sample.name.endswith("_count") and sample.value == 1 for sample in passes)


def test_forward_only_joins_shared_passes_unless_it_asks_for_full_logits(tmp_path):
    """A tenant's log-prob reads share passes as its training does; ``return_logits`` (large, for checks) runs
    alone. Both read the same log-probs."""
    client, keys = _start(tmp_path, ("ann",))
    headers = keys["ann"]
    with client:
        run_id = _new_run(client, headers)
        telemetry = client.app.state.server.telemetry

        def passes() -> float:
            samples = telemetry.pass_requests.collect()[0].samples
            return sum(sample.value for sample in samples if sample.name.endswith("_count"))

        shared = _call(client, headers, run_id, "forward_only", inputs=_features(0, 2), return_logits=False)
        assert passes() == 1
        alone = _call(client, headers, run_id, "forward_only", inputs=_features(0, 2), return_logits=True)
        assert passes() == 1
    assert len(shared["logps"]) == len(alone["logps"]) == 2
    for read, reference in zip(shared["logps"], alone["logps"], strict=True):
        assert read == pytest.approx(reference, abs=1e-6)  # each read alone, collated alike: the same kernels
    assert shared["loss"] == pytest.approx(alone["loss"], abs=1e-6)


def test_update_optimizer_changes_the_runs_hyperparameters_in_place(tmp_path):
    client, keys = _start(tmp_path, ("ann",))
    headers = keys["ann"]
    with client:
        run_id = _new_run(client, headers)
        _call(client, headers, run_id, "set_optimizer", optimizer_cls="AdamW", lr=1e-2)
        assert _call(client, headers, run_id, "update_optimizer", lr=0.25) is None
        _call(client, headers, run_id, "forward_backward", inputs=_features(0, 2))
        assert _call(client, headers, run_id, "clip_grad_and_step")["lr"] == 0.25
        body = {"method": "update_optimizer", "kwargs": {"momentum": 0.9}}
        reply = client.post(f"{API}/runs/{run_id}/call", headers=headers, json=body)
    assert reply.status_code == 400
    assert "AdamW has no hyper-parameter 'momentum'" in reply.json()["error"]["message"]


def test_a_long_call_done_within_its_wait_answers_its_result_and_a_failed_one_its_future(tmp_path):
    """``POST .../call?wait=S`` spares the client the future's long-poll: the same result a poll would give."""
    client, keys = _start(tmp_path, ("ann",))
    headers = keys["ann"]
    with client:
        run_id = _new_run(client, headers)

        def post(method, wait=None, **kwargs):
            params = {} if wait is None else {"wait": wait}
            body = {"method": method, "kwargs": kwargs}
            return client.post(f"{API}/runs/{run_id}/call", headers=headers, params=params, json=body).json()

        failed = post("clip_grad_and_step", wait=30)  # no optimizer yet: the call fails in the scheduler
        state = client.get(f"{API}/futures/{failed['future_id']}", headers=headers).json()
        assert (state["status"], state["error"]["type"]) == ("failed", "ConfigurationError")
        inline = post("forward_backward", wait=30, inputs=_features(0, 2))["result"]
        polled = _wait(client, headers, post("forward_backward", inputs=_features(0, 2))["future_id"])  # no wait
        assert "future_id" in post("forward_backward", wait="nan", inputs=_features(0, 2))  # NaN waits for nothing
    assert inline["loss"] == pytest.approx(polled["loss"], abs=1e-6)  # no step between: the same weights
    assert inline.keys() == polled.keys()


def _trained_run(client, headers, user):
    """A run of ``user``'s adapter after one step (so it samples differently from the base model)."""
    run_id = _new_run(client, headers, user)
    _call(client, headers, run_id, "set_optimizer", optimizer_cls="AdamW", lr=5e-2)
    _call(client, headers, run_id, "forward_backward", inputs=_features(len(user), 2))
    _call(client, headers, run_id, "clip_grad_and_step")
    return run_id


def _sample_batches(client) -> tuple[float, float]:
    """How many sample batches the server ran so far, and how many sample calls they held."""
    text = client.get("/metrics").text
    count, total = (
        re.search(rf"^twinkle_sample_batch_requests_{name} (\S+)$", text, re.M) for name in ("count", "sum")
    )
    assert count is not None and total is not None
    return float(count[1]), float(total[1])


def test_tenants_samples_in_flight_together_are_one_batch_each_as_if_alone(tmp_path):
    """Greedy samples of two tenants' runs (each synced after its step) and of the base model, sent while the
    worker is busy, are generated in batches (``/metrics``), each with the tokens and log-probs it gets alone."""
    client, keys = _start(tmp_path)
    greedy = {"max_tokens": 6, "temperature": 0.0, "logprobs": True}
    with client:
        runs = {user: _trained_run(client, keys[user], user) for user in keys}
        prompts = [[{"input_ids": [151644, 872, 198, 9707 + index]}] for index in range(4)]
        requests = [  # each tenant's run twice, and the base model
            ("ann", {"run_id": runs["ann"], "inputs": prompts[0]}),
            ("ben", {"run_id": runs["ben"], "inputs": prompts[0]}),
            ("ann", {"inputs": prompts[1]}),
            ("ben", {"run_id": runs["ben"], "inputs": prompts[2], "num_samples": 2}),
            ("ann", {"run_id": runs["ann"], "inputs": prompts[3]}),
        ]
        before = _sample_batches(client)
        busy = {"inputs": [{"input_ids": list(range(1, 400))}] * 4}  # keeps the worker busy while the samples queue
        reply = client.post(
            f"{API}/runs/{runs['ann']}/call", headers=keys["ann"], json={"method": "forward_only", "kwargs": busy}
        )
        sent = [
            client.post(f"{API}/sample", headers=keys[user], json={**body, "sampling_params": greedy}).json()
            for user, body in requests
        ]
        together = [_wait(client, keys[user], f["future_id"]) for (user, _), f in zip(requests, sent, strict=True)]
        if "future_id" in reply.json():
            _wait(client, keys["ann"], reply.json()["future_id"])
        batches, calls = (after - first for after, first in zip(_sample_batches(client), before, strict=True))
        assert calls == len(requests) and batches < calls, (batches, calls)
        for (user, body), response in zip(requests, together, strict=True):
            again = client.post(f"{API}/sample", headers=keys[user], json={**body, "sampling_params": greedy}).json()
            alone = _wait(client, keys[user], again["future_id"])
            assert [s["tokens"] for s in response["sequences"]] == [s["tokens"] for s in alone["sequences"]]
            for ours, theirs in zip(response["sequences"], alone["sequences"], strict=True):
                assert max(abs(a - b) for a, b in zip(ours["logprobs"], theirs["logprobs"], strict=True)) <= 1e-4
        by_weights = [together[0]["sequences"][0]["logprobs"], together[1]["sequences"][0]["logprobs"]]
        assert by_weights[0] != by_weights[1], "each tenant's samples come from its own adapter"
