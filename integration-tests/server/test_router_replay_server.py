"""Router replay through the server (``record_routing: true``) on the MoE builtin, with the native client.

The server runs in this process on 127.0.0.1 (uvicorn in a thread), so the test can drift its trainer's
router as an update the sampler has not seen would. A tenant samples with the server's sampler, which
records every token's experts in the completion's ``new_input_feature``; the tenant sends that feature
back to ``forward_backward``, and the trainer routes each token to the recorded experts. The drift gives
each layer's router an expert that the sampler never chose for these tokens a copy (doubled) of a
chosen one's router row: free routing then sends those tokens to it, while the replayed tokens keep
their recorded experts, whose weights (softmax renormalised over the chosen experts, as Qwen3-MoE's
``norm_topk_prob``) do not read the drifted row. So with replay the trainer's log-probs equal the
sampler's, and without it they differ (asserted, so that the drift is real). Records that do not fit
the model are refused with a 400 naming the problem, before they could fail a pass shared with another
tenant, whose training goes on.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import uvicorn

from twinkle.data_format import SamplingParams
from twinkle.errors import InvalidInputError
from twinkle.module import topk_routers
from twinkle.server.application import create_app
from twinkle.server.config import ServerConfig, UserConfig
from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.checkpoint_engine import CheckpointEngineManager
from twinkle_client.http import API_PREFIX
from twinkle_client.model import TransformersModel
from twinkle_client.sampler import TorchSampler

sys.path.insert(0, str(Path(__file__).parents[1]))
from torchrun_harness import free_port

pytestmark = [pytest.mark.integration]

MOE = "builtin://qwen3-moe-tiny"
USERS = ("ann", "ben")
PROMPT = {"input_ids": [151644, 872]}  # 2 prompt tokens + 2 sampled: 3 recorded tokens (the last one is free)
LORA = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
TOLERANCE = 1e-5


def api_key(user: str) -> str:
    return f"tml-{user}-replay-key-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The running server's application (its state is ``app.state.server``), stopped when the module ends."""
    config = ServerConfig(
        model_id=MOE,
        device="cpu",
        port=free_port(),
        state_dir=tmp_path_factory.mktemp("replay-server"),
        record_routing=True,
        users={user: UserConfig(api_keys=[api_key(user)]) for user in USERS},
    )
    app = create_app(config)
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, name="replay-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uvicorn_server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert uvicorn_server.started, "the server did not start"
    app.state.url, app.state.clients = f"http://127.0.0.1:{config.port}", []
    yield app
    for client in app.state.clients:
        client.close()
    uvicorn_server.should_exit = True
    thread.join(timeout=60)


def _connect(app: Any, user: str) -> tuple[TransformersModel, TorchSampler]:
    app.state.clients.append(init_twinkle_client(app.state.url, api_key(user)))
    return _model_and_sampler()


def _model_and_sampler() -> tuple[TransformersModel, TorchSampler]:
    """A LoRA run and a sampler synced with it, on the current client's server."""
    model = TransformersModel(model_id=MOE)
    model.add_adapter_to_model("default", LORA, seed=0)
    model.set_optimizer("AdamW", lr=1e-3)
    sampler = TorchSampler(MOE)
    CheckpointEngineManager(model, sampler).sync_weights()
    return model, sampler


def _drift_unchosen_experts(trainer: torch.nn.Module, record: list[list[list[int]]]) -> None:
    """Per layer: for each token that predicts a sampled one, an expert no recorded token chose takes a doubled
    copy of that token's first expert's router row, so that free routing prefers it there."""
    recorded = torch.tensor(record[:-1])  # [tokens, layers, top_k]; the last token has no record
    with torch.no_grad():
        for layer, router in enumerate(topk_routers(trainer)):
            unchosen = sorted(set(range(router.num_experts)) - set(recorded[:, layer].flatten().tolist()))
            for token, spare in zip(range(1, len(record) - 1), unchosen, strict=False):
                router.weight[spare] = 2 * router.weight[recorded[token, layer, 0]]


def _completion_gap(logps: Any, sampled: list[float]) -> float:
    ours = np.asarray(logps[0], dtype=np.float64)[-len(sampled) :]
    return float(np.abs(ours - np.asarray(sampled, dtype=np.float64)).max())


def test_replayed_logps_equal_the_samplers_with_a_drifted_router(server):
    model, sampler = _connect(server, "ann")
    params = SamplingParams(max_tokens=2, num_samples=1, logprobs=0, seed=7)
    sequence = sampler.sample(PROMPT, params).sequences[0]
    feature, sampled = dict(sequence.new_input_feature), list(sequence.logprobs)
    record = feature["routed_experts"]
    assert len(record) == len(feature["input_ids"]) == 4 and len(sampled) == 2
    assert np.asarray(record).shape[1:] == (4, 2)  # 4 MoE layers x top-2
    _drift_unchosen_experts(server.state.server.engine.pool.model.model, record)
    replayed = model.forward_backward(inputs=[feature])
    free = model.forward_only(inputs=[{k: v for k, v in feature.items() if k != "routed_experts"}])
    with_replay, without = _completion_gap(replayed.logps, sampled), _completion_gap(free.logps, sampled)
    print(f"max |sampler - trainer| log-prob, drifted router: {with_replay:.1e} with replay, {without:.1e} without")
    assert with_replay <= TOLERANCE
    assert without > 10 * TOLERANCE  # the drift changes free routing: without replay the test would fail


def test_records_that_do_not_fit_are_refused_and_others_train_on(server):
    model, sampler = _connect(server, "ben")
    feature = dict(sampler.sample(PROMPT, SamplingParams(max_tokens=2, seed=1)).sequences[0].new_input_feature)
    record = feature["routed_experts"]
    bad_ids = [[[0, 8]] * 4 for _ in record]
    bad = {
        r"routed_experts records 2 layer\(s\) x top-2; the server's model has 4 MoE layer\(s\) x top-2": [
            layers[:2] for layers in record
        ],
        r"routed_experts holds expert id 8; the server's model has 8 experts": bad_ids,
        r"routed_experts must hold one entry per token \(4\), got 3": record[:-1],
    }
    for message, routed in bad.items():
        with pytest.raises(InvalidInputError, match=r"inputs\[1\]\." + message):
            model.forward_backward(inputs=[feature, {**feature, "routed_experts": routed}])
    # Refused at the HTTP edge (400 to the request itself, no future): it never joins a pass shared with others.
    body = {"method": "forward_backward", "kwargs": {"inputs": [{**feature, "routed_experts": bad_ids}]}}
    reply = httpx.post(
        f"{server.state.url}{API_PREFIX}/runs/{model.run_id('default')}/call",
        json=body,
        headers={"Authorization": f"Bearer {api_key('ben')}"},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "InvalidInputError" and "expert id 8" in reply.json()["error"]["message"]
    loss = model.forward_backward(inputs=[feature]).loss  # the run is untouched and trains on
    assert np.isfinite(loss)
    model.clip_grad_and_step()


@pytest.mark.slow  # Ray's start-up: about 35 s on 2 cores
def test_ray_replicas_record_and_check_routing_too(start_server):
    """``--ray``: the option reaches the replica's sampler, and records are checked against the routing it reports."""
    server = start_server(["cai"], args=["--ray"], model_id=MOE, record_routing=True)
    with init_twinkle_client(server.url, server.keys["cai"]):
        model, sampler = _model_and_sampler()
        sequence = sampler.sample(PROMPT, SamplingParams(max_tokens=2, logprobs=0, seed=7)).sequences[0]
        feature = dict(sequence.new_input_feature)
        assert np.asarray(feature["routed_experts"]).shape == (4, 4, 2)
        replayed = model.forward_backward(inputs=[feature])
        assert _completion_gap(replayed.logps, list(sequence.logprobs)) <= TOLERANCE
        with pytest.raises(InvalidInputError, match=r"inputs\[0\]\.routed_experts holds expert id 8"):
            model.forward_backward(inputs=[{**feature, "routed_experts": [[[0, 8]] * 4] * 4}])
