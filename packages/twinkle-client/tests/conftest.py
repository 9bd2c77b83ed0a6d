"""A fake Twinkle server behind ``httpx.MockTransport``: the native API's shapes, in memory, no sockets."""

from __future__ import annotations

import json
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from twinkle import wire
from twinkle.data_format import SampledSequence, SampleResponse
from twinkle_client import context, init_twinkle_client

BASE_MODEL = "builtin://qwen3-tiny"
SHORT_METHODS = {"set_optimizer", "set_lr_scheduler", "set_loss", "set_template", "set_processor"}
SHORT_METHODS |= {"update_optimizer", "zero_grad", "lr_step", "calculate_metric"}


@dataclass
class Seen:
    method: str
    path: str
    params: dict[str, str]
    headers: httpx.Headers
    body: Any


class FakeServer:
    """Answers like the server spec; ``script`` queues outcomes (responses or exceptions) for a route first."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.scripted: dict[tuple[str, str], deque[Any]] = defaultdict(deque)
        self.results: dict[str, Any] = {
            "forward_backward": {"loss": 1.25, "logps": [np.array([-0.5, -1.0], np.float32)], "num_tokens": 2},
            "clip_grad_and_step": {"stepped": True, "grad_norm": 0.5, "lr": 0.001, "global_step": 1},
            "calculate_metric": {"loss": 1.25},
        }
        self.pending_polls = 0  # how many polls of each future answer "pending" first
        self.futures: dict[str, dict[str, Any]] = {}
        self.runs: list[str] = []
        self.dataset_length, self.loader_length = 10, 3
        self.loader_position = [0, 0]  # epoch, batch

    @staticmethod
    def error(status: int, type_name: str, message: str, **extra: Any) -> httpx.Response:
        """An error reply as the spec writes it (JSON ``{"error": {"type", "message"}}``)."""
        return httpx.Response(status, json={"error": {"type": type_name, "message": message, **extra}})

    @staticmethod
    def json_reply(value: Any, status: int = 200) -> httpx.Response:
        return httpx.Response(status, content=json.dumps(value), headers={"content-type": "application/json"})

    def script(self, method: str, path: str, *outcomes: Any) -> None:
        self.scripted[(method, path)].extend(outcomes)

    def requests(self, method: str, path: str) -> list[Seen]:
        return [s for s in self.seen if (s.method, s.path) == (method, path)]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/twinkle/v1")
        content_type = request.headers.get("content-type", "")
        body = wire.decode(request.content) if content_type == wire.CONTENT_TYPE else None
        self.seen.append(Seen(request.method, path, dict(request.url.params), request.headers, body))
        queue = self.scripted.get((request.method, path))
        if queue:
            outcome = queue.popleft()
            if isinstance(outcome, Exception):
                raise outcome
            if isinstance(outcome, httpx.Response):
                return outcome
            return _wire(outcome)
        return _wire(self._answer(request.method, path, body))

    def _answer(self, method: str, path: str, body: Any) -> Any:
        if (method, path) == ("POST", "/sessions"):
            return {"session_id": "s1"}
        if method in ("POST", "DELETE") and path.startswith("/sessions/"):
            return {}
        if path == "/server_info":
            return {"base_model": BASE_MODEL, "max_rank": 64, "max_loras": 8, "version": "0.1.0"}
        if (method, path) == ("POST", "/runs"):
            self.runs.append(f"run-{len(self.runs) + 1}")
            return {"run_id": self.runs[-1]}
        if match := re.fullmatch(r"/runs/([^/]+)/call", path):
            name = body["method"]
            result = f"twinkle://{match[1]}/weights/{body['kwargs']['name']}" if name == "save" else None
            result = self.results.get(name, result)
            return {"result": result} if name in SHORT_METHODS else self._future(result)
        if match := re.fullmatch(r"/futures/([^/]+)", path):
            future = self.futures[match[1]]
            if future["polls"] < self.pending_polls:
                future["polls"] += 1
                return {"status": "pending"}
            return {"status": "done", "result": future["result"]}
        if match := re.fullmatch(r"/runs/([^/]+)/checkpoints", path):
            return {"checkpoints": [{"name": "c1", "path": f"twinkle://{match[1]}/weights/c1", "created_at": 1.0}]}
        if method == "DELETE" and "/checkpoints/" in path:
            return {}
        if match := re.fullmatch(r"/runs/([^/]+)/checkpoints/([^/]+)/ttl", path):
            expires_at = None if body["ttl_seconds"] is None else 1.0 + body["ttl_seconds"]
            return {
                "name": match[2],
                "path": f"twinkle://{match[1]}/{match[2]}",
                "created_at": 1.0,
                "expires_at": expires_at,
            }
        if path == "/sample":
            return self._future(_sample_response(body).to_dict())
        if path == "/datasets":
            return {"handle": f"ds-{len(self.requests('POST', '/datasets'))}", "length": self.dataset_length}
        if path == "/dataloaders":
            return {"handle": "dl-1", "length": self.loader_length}
        if path == "/dataloaders/dl-1/next":
            return self._next_batch()
        if path == "/templates/encode":
            return {"features": [{"input_ids": [len(t["messages"])] * 3} for t in body["trajectories"]]}
        if path == "/templates/decode":
            return {"texts": [" ".join(map(str, ids)) for ids in body["token_ids"]]}
        return self.error(404, "ResourceNotFoundError", f"no route {method} {path}")

    def _future(self, result: Any) -> dict[str, str]:
        future_id = f"f{len(self.futures) + 1}"
        self.futures[future_id] = {"result": result, "polls": 0}
        return {"future_id": future_id}

    def _next_batch(self) -> dict[str, Any]:
        epoch, index = self.loader_position
        if index == self.loader_length:  # the end marker, then the next epoch starts
            self.loader_position = [epoch + 1, 0]
            return {"end": True}
        self.loader_position = [epoch, index + 1]
        return {"batch": [{"input_ids": [epoch, index]}]}


def _sample_response(body: dict[str, Any]) -> SampleResponse:
    sequences = [
        SampledSequence(tokens=[7, 8], stop_reason="stop", logprobs=[-0.5, -0.25], decoded="7 8")
        for _ in range(len(body["inputs"]) * body["num_samples"])
    ]
    return SampleResponse(sequences=sequences)


def _wire(value: Any) -> httpx.Response:
    if isinstance(value, httpx.Response):
        return value
    return httpx.Response(200, content=wire.encode(value), headers={"content-type": wire.CONTENT_TYPE})


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def client(server, monkeypatch):
    """The process-wide client, connected to ``server``; closed (and forgotten) after the test."""
    monkeypatch.setattr(context, "_client", None)
    client = init_twinkle_client(
        "http://twinkle.test",
        "key-1",
        transport=httpx.MockTransport(server),
        retry_backoff=0.0,
        heartbeat_interval=3600,
    )
    yield client
    client.close()
