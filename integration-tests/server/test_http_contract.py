"""The HTTP contract as a client in another language sees it: ``/openapi.json`` alone.

- Every POST/PUT operation declares its request body and every operation its reply, with errors in one shape.
- Schemathesis, reading only the schema, sends over a thousand generated requests (coverage, fuzzing and
  stateful phases) in JSON and in the wire codec: no 5xx, no reply outside its documented status, media type
  or schema, no traceback in the server's log.
- A client generated from the schema (datamodel-code-generator) reads the replies of a real training session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from twinkle import wire

HERE = Path(__file__).parent
USER = "fuzzer"
CLIENT = "client"
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
MIN_CASES = 1000
# About 4 minutes on an idle 2-core machine; the margin is for CI machines, slower and busy with other tests.
FUZZ_TIMEOUT_S = 1200
API = "/twinkle/v1"


@pytest.fixture(scope="module")
def server(start_server):
    # The rate limit would answer most generated requests with 429 before they reach a route; the token quota
    # bounds the work of one accepted request (a sample of 2,000 tokens would hold the model for seconds).
    return start_server([USER], quotas={"requests_per_second": 1e6, "max_tokens_per_request": 1024})


@pytest.fixture(scope="module")
def schema(server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/openapi.json", timeout=30).json()


def _operations(schema: dict[str, Any]):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            yield method.upper(), path, operation


def test_every_body_and_reply_is_declared_and_errors_share_one_shape(schema):
    missing = []
    for method, path, operation in _operations(schema):
        if method in ("POST", "PUT") and not operation.get("requestBody", {}).get("content"):
            missing.append(f"{method} {path}: no request body")
        if not operation["responses"].get("200", {}).get("content"):
            missing.append(f"{method} {path}: no reply schema")
        expected_error = (
            "TinkerError" if path.startswith("/api/v1") else "OpenAIError" if path.startswith("/v1/") else "ErrorReply"
        )
        for status in ("400", "401", "404", "422", "500"):
            content = operation["responses"].get(status, {}).get("content", {})
            if content.get("application/json", {}).get("schema", {}).get("$ref", "").split("/")[-1] != expected_error:
                missing.append(f"{method} {path}: {status} is not a {expected_error}")
    assert not missing, "\n".join(missing)
    assert len(list(_operations(schema))) >= 48
    # The wire codec is offered next to JSON for native bodies and replies.
    call = schema["paths"][f"{API}/runs/{{run_id}}/call"]["post"]
    assert wire.CONTENT_TYPE in call["requestBody"]["content"]
    assert wire.CONTENT_TYPE in call["responses"]["200"]["content"]
    # Per-method arguments are documented, e.g. what forward_backward takes.
    forward_backward = schema["components"]["schemas"]["ForwardBackward"]
    assert {"inputs", "micro_batch_size"} <= set(forward_backward["properties"])


def test_bad_fields_are_named_in_the_error(server):
    headers = server.headers(USER)
    session = httpx.post(f"{server.url}{API}/sessions", json={}, headers=headers, timeout=30).json()["session_id"]
    cases = [
        ({"session_id": session, "gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"session_id": session, "lora_config": {"r": "eight"}}, "lora_config.r"),
        ({"session_id": session, "sedd": 3}, "sedd"),
    ]
    for body, field in cases:
        reply = httpx.post(f"{server.url}{API}/runs", json=body, headers=headers, timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["type"] == "InvalidInputError" and error["field"] == field, error
    wrong_verb = httpx.put(f"{server.url}{API}/sessions", headers=headers, timeout=30)
    assert wrong_verb.status_code == 405 and wrong_verb.json()["error"]["type"] == "InvalidInputError"
    assert wrong_verb.headers["allow"] == "POST"


def test_schemathesis_finds_no_failure(server, tmp_path):
    report = tmp_path / "events.ndjson"
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json"),
        *("--header", f"Authorization: Bearer {server.keys[USER]}"),
        *("--phases", "coverage,fuzzing,stateful", "--max-examples", "3", "--seed", "1", "--workers", "1"),
        *("--checks", CHECKS, "--request-timeout", "60", "--no-color", "--generation-database", "none"),
        # Health checks judge the generator (e.g. few random strings survive as a URL path segment), not the server.
        *("--suppress-health-check", "filter_too_much,too_slow"),
        *("--report", "ndjson", "--report-ndjson-path", str(report)),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(HERE)}
    run = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_TIMEOUT_S, check=False
    )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    statuses = _statuses(report)
    cases = sum(statuses.values())
    print(f"\nschemathesis: {cases} requests")
    for mode in ("positive", "negative"):
        sent = {status: count for (kind, status), count in statuses.items() if kind == mode}
        rejected = sent.get("400", 0) + sent.get("422", 0)
        print(
            f"  {mode} (schema-valid: {mode == 'positive'}): {sum(sent.values())} sent, "
            f"{rejected / max(sum(sent.values()), 1):.0%} refused with 400/422; {dict(sorted(sent.items()))}"
        )
    assert cases >= MIN_CASES
    assert not server.errors(), "\n".join(server.errors()[:20])


def _statuses(report: Path) -> Counter[tuple[str, str]]:
    """Replies by generation mode (``positive``: data the schema allows) and status class."""
    statuses: Counter[tuple[str, str]] = Counter()
    for line in report.read_text().splitlines():
        recorder = (json.loads(line).get("ScenarioFinished") or {}).get("recorder") or {}
        for case_id, interaction in recorder.get("interactions", {}).items():
            if interaction.get("response"):
                mode = recorder["cases"][case_id]["value"]["meta"]["generation"]["mode"]
                status = interaction["response"]["status_code"]
                statuses[mode, "2xx" if status < 300 else str(status)] += 1
    return statuses


def _generated_client(schema: dict[str, Any], folder: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pydantic models generated from the schema alone, imported: they check every reply's types at run time."""
    source, models = folder / "openapi.json", folder / "twinkle_api_models.py"
    source.write_text(json.dumps(schema))
    generate = [sys.executable, "-m", "datamodel_code_generator", "--input", str(source)]
    generate += [
        "--input-file-type",
        "openapi",
        "--output-model-type",
        "pydantic_v2.BaseModel",
        "--output",
        str(models),
    ]
    subprocess.run(generate, check=True, capture_output=True, timeout=300)
    spec = importlib.util.spec_from_file_location("twinkle_api_models", models)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # pydantic resolves the generated generics through it
    spec.loader.exec_module(module)
    return module


def test_a_client_generated_from_the_schema_reads_real_replies(start_server, schema, tmp_path, monkeypatch):
    api = _generated_client(schema, tmp_path, monkeypatch)
    # A server of its own: the fuzzer's accepted calls (sampling thousands of tokens) keep its model busy for minutes.
    server = start_server([CLIENT])
    headers, url = server.headers(CLIENT), f"{server.url}{API}"

    def read(model: Any, reply: httpx.Response) -> Any:
        assert reply.status_code == 200, reply.text
        return model.model_validate(reply.json())

    def wait(future_id: str) -> Any:
        deadline = time.monotonic() + 300
        while True:
            poll = httpx.get(f"{url}/futures/{future_id}?wait=30", headers=headers, timeout=60)
            reply = read(api.FutureReply, poll)
            if reply.status.value != "pending" or time.monotonic() > deadline:
                break
        assert reply.status.value == "done", reply
        return None if reply.result is None else reply.result.model_dump(mode="json")

    def call(run_id: str, method: str, **kwargs: Any) -> Any:
        body = api.CallRequest.model_validate({"method": method, "kwargs": kwargs}).model_dump(mode="json")
        reply = httpx.post(f"{url}/runs/{run_id}/call", json=body, headers=headers, timeout=60).json()
        return wait(api.FutureCreated.model_validate(reply).future_id) if "future_id" in reply else reply["result"]

    info = read(api.ServerInfo, httpx.get(f"{url}/server_info", headers=headers, timeout=30))
    assert info.max_rank >= 8
    session = read(api.SessionCreated, httpx.post(f"{url}/sessions", json={}, headers=headers, timeout=30))
    create = api.CreateRun(session_id=session.session_id, lora_config={"r": 4, "target_modules": ["q_proj"]}, seed=1)
    run_body = create.model_dump(mode="json", exclude_none=True)
    run = read(api.RunCreated, httpx.post(f"{url}/runs", json=run_body, headers=headers, timeout=120))
    call(run.run_id, "set_optimizer", optimizer_cls="AdamW", lr=1e-3)
    features = read(
        api.Features,
        httpx.post(
            f"{url}/templates/encode",
            json={
                "trajectories": [
                    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
                ]
            },
            headers=headers,
            timeout=60,
        ),
    ).features
    inputs = [feature.model_dump(mode="json", exclude_none=True) for feature in features]
    output = call(run.run_id, "forward_backward", inputs=inputs)
    assert output["loss"] > 0
    call(run.run_id, "clip_grad_and_step")
    path = call(run.run_id, "save", name="contract")
    listing = read(api.RunListing, httpx.get(f"{url}/runs/{run.run_id}", headers=headers, timeout=30))
    assert [checkpoint.path for checkpoint in listing.checkpoints] == [path]
    ttl = httpx.put(f"{url}/runs/{run.run_id}/checkpoints/contract/ttl", json={"ttl_seconds": 60}, headers=headers)
    assert read(api.CheckpointListing, ttl).expires_at is not None
    error = httpx.post(f"{url}/runs/{run.run_id}/call", json={"method": "nope"}, headers=headers, timeout=30)
    assert api.ErrorReply.model_validate(error.json()).error.type == "InvalidInputError"
