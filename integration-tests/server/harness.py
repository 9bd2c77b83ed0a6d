"""What the fault and load tests share: tiny batches, the solo in-process reference, raw HTTP, status records."""

from __future__ import annotations

import random
import socket
from typing import Any

import httpx
from peft import LoraConfig

from twinkle import wire
from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.model import MultiLoraModel
from twinkle_client.http import TwinkleClient

LORA = {"r": 1, "lora_alpha": 2, "target_modules": ["q_proj"]}
LR = 1e-2


def batch(tag: str, step: int, samples: int = 1, length: int = 8) -> list[dict[str, Any]]:
    """A deterministic labelled batch of random token ids (the first token unsupervised)."""
    rng = random.Random(f"{tag}-{step}")
    features = []
    for _ in range(samples):
        ids = [rng.randrange(100, 5000) for _ in range(length)]
        features.append(make_input_feature(ids, [IGNORE_INDEX, *ids[1:]]))
    return features


def token_count(inputs: list[dict[str, Any]]) -> int:
    return sum(len(feature["input_ids"]) for feature in inputs)


def new_run(client: TwinkleClient, seed: int) -> str:
    """A LoRA run with AdamW, set up as :class:`SoloReference` sets up its adapter."""
    run_id = client.create_run(LORA, seed=seed)
    client.call(run_id, "set_optimizer", optimizer_cls="AdamW", lr=LR)
    return run_id


class SoloReference:
    """One tenant's adapter trained alone in this process: what the server must give that tenant."""

    def __init__(self, seed: int, model: MultiLoraModel | None = None, name: str = "solo") -> None:
        self.model = model or MultiLoraModel(device="cpu")
        self.name = name
        self.model.add_adapter_to_model(name, LoraConfig(**LORA), seed=seed)
        self.model.set_optimizer("AdamW", adapter_name=name, lr=LR)

    def forward_backward(self, inputs: list[dict[str, Any]]) -> float:
        return self.model.forward_backward(inputs, adapter_name=self.name).loss

    def clip_grad_and_step(self) -> dict[str, Any]:
        return self.model.clip_grad_and_step(adapter_name=self.name)

    def eval_loss(self, inputs: list[dict[str, Any]]) -> float:
        return self.model.forward_only(inputs, adapter_name=self.name).loss

    def train(self, batches: list[list[dict[str, Any]]]) -> list[float]:
        """``forward_backward`` + ``clip_grad_and_step`` per batch; the losses."""
        losses = []
        for inputs in batches:
            losses.append(self.forward_backward(inputs))
            self.clip_grad_and_step()
        return losses

    def close(self) -> None:
        self.model.remove_adapter(self.name)


def call_body(method: str, idempotency_key: str | None = None, **kwargs: Any) -> dict[str, Any]:
    return {"method": method, "kwargs": kwargs, "idempotency_key": idempotency_key}


def hang_up(port: int, method: str, path: str, api_key: str, body: bytes = b"", send: int | None = None) -> None:
    """Send a request with ``body`` in the wire codec, but only its first ``send`` bytes (all of it when
    ``send`` is None), then close the connection without reading any reply."""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {api_key}\r\n"
        f"Content-Type: {wire.CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head.encode() + body[: len(body) if send is None else send])


class StatusLog(httpx.HTTPTransport):
    """An httpx transport that records every response's ``(method, path, status)`` in ``statuses``."""

    def __init__(self, statuses: list[tuple[str, str, int]] | None = None) -> None:
        super().__init__()
        self.statuses = [] if statuses is None else statuses

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self.statuses.append((request.method, request.url.path, response.status_code))
        return response
