"""The real server process under faults: a SIGKILL mid-training, clients hanging up mid-call, bad requests.

What must hold: nothing saved is lost, nothing is half-applied or applied
twice, a call cut off by a crash says so, and one tenant's garbage costs the
other tenants nothing — their training equals what they get alone in-process.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from twinkle import wire
from twinkle.errors import ServerError, TwinkleError
from twinkle_client.http import TwinkleClient

sys.path.insert(0, str(Path(__file__).parent))
from harness import (
    LR,
    SoloReference,
    batch,
    call_body,
    hang_up,
    new_run,
    token_count,
)

pytestmark = pytest.mark.integration

SEED = 5
EVAL = batch("eval", 0, samples=2, length=12)


def test_sigkill_mid_forward_backward_loses_no_checkpoint_and_resumes_exactly(start_server):
    """A training loop saves twice; the server is SIGKILLed while the loop's next forward_backward is in flight.

    The batch the kill lands in is long (thousands of tokens), so its future is surely still in flight.
    """
    server = start_server(["alice"])
    # Enough retries to outlast the restart: the loop's long-poll must reach the restarted server.
    trainer = TwinkleClient(server.url, server.keys["alice"], max_retries=10, retry_backoff=0.5)
    run_id = new_run(trainer, SEED)
    saved: dict[str, tuple[float, list]] = {}  # checkpoint -> forward_only(EVAL) (loss, logps) right after saving
    submitted: queue.Queue[tuple[int, str]] = queue.Queue()
    outcome: dict[str, Any] = {}
    last_step = 4

    def train() -> None:
        try:
            for step in range(last_step + 1):
                inputs = batch("alice", step) if step < last_step else batch("alice", step, samples=4, length=1024)
                body = call_body("forward_backward", f"alice-{step}", inputs=inputs)
                future_id = trainer.request("POST", f"/runs/{run_id}/call", body, retry_safe=True)["future_id"]
                submitted.put((step, future_id))
                trainer.wait(future_id)
                trainer.call(run_id, "clip_grad_and_step")
                if step in (1, 3):
                    trainer.call(run_id, "save", name=f"step-{step}", save_optimizer=True)
                    evaluated = trainer.call(run_id, "forward_only", inputs=EVAL)
                    saved[f"step-{step}"] = (evaluated["loss"], evaluated["logps"])
        except TwinkleError as exc:
            outcome["error"] = exc

    loop = threading.Thread(target=train, name="training-loop")
    loop.start()
    step = -1
    while step < last_step:
        step, in_flight = submitted.get(timeout=300)
    server.kill()
    server.start()
    loop.join(timeout=180)
    assert not loop.is_alive(), "the training loop did not hear back after the restart"

    # The loop's long-poll outlived the restart and reports the lost call clearly.
    error = outcome.get("error")
    assert isinstance(error, ServerError), outcome
    assert "restarted while this call was in flight" in str(error)
    assert "1 calls were in flight when the server stopped" in server.log()
    trainer.close()

    with TwinkleClient(server.url, server.keys["alice"]) as resumer:
        state = resumer.request("GET", f"/futures/{in_flight}")
        assert state["status"] == "failed" and state["error"]["type"] == "ServerError", state
        [run] = resumer.list_runs()
        assert run["run_id"] == run_id and run["resident"] is False
        assert [c["name"] for c in resumer.list_checkpoints(run_id)] == ["step-1", "step-3"]
        assert set(saved) == {"step-1", "step-3"}

        resumer.resume_run(run_id)
        assert resumer.get_run(run_id)["resident"] is True
        resumer.call(run_id, "set_optimizer", optimizer_cls="AdamW", lr=LR)  # a fresh adapter: no optimizer yet
        for name, (loss, logps) in saved.items():
            resumer.call(run_id, "load", path=f"twinkle://{run_id}/{name}", load_optimizer=True)
            evaluated = resumer.call(run_id, "forward_only", inputs=EVAL)
            assert evaluated["loss"] == loss, name  # bit for bit: the same weights, the same computation
            for resumed, before in zip(evaluated["logps"], logps, strict=True):
                np.testing.assert_array_equal(resumed, before)
        stepped = resumer.call(run_id, "clip_grad_and_step")  # nothing accumulated since the load: no step
        assert stepped == {"stepped": False, "accumulated": 0}


@pytest.fixture(scope="module")
def server(start_server):
    """Users: carol hangs up on calls, mallory sends garbage (token quota 512), ann and bob train meanwhile."""
    quotas = {"carol": {"requests_per_second": 1000.0}, "mallory": {"max_tokens_per_request": 512}}
    return start_server(["carol", "mallory", "ann", "bob"], user_quotas=quotas)


def _half_the_body(server, run_id: str, body: dict[str, Any]) -> None:
    data = wire.encode(body)
    hang_up(server.port, "POST", f"/twinkle/v1/runs/{run_id}/call", server.keys["carol"], data, send=len(data) // 2)


def _reply_never_read(server, run_id: str, body: dict[str, Any]) -> None:
    hang_up(server.port, "POST", f"/twinkle/v1/runs/{run_id}/call", server.keys["carol"], wire.encode(body))


def _one_millisecond_timeout(server, run_id: str, body: dict[str, Any]) -> None:
    headers = {**server.headers("carol"), "Content-Type": wire.CONTENT_TYPE}
    with suppress(httpx.TimeoutException):
        httpx.post(
            f"{server.url}/twinkle/v1/runs/{run_id}/call", content=wire.encode(body), headers=headers, timeout=0.001
        )


def _long_poll_abandoned(server, run_id: str, body: dict[str, Any]) -> None:
    with httpx.Client(base_url=f"{server.url}/twinkle/v1", headers=server.headers("carol")) as http:
        reply = http.post(f"/runs/{run_id}/call", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        with suppress(httpx.TimeoutException):
            http.get(f"/futures/{reply.json()['future_id']}", params={"wait": 30}, timeout=0.05)


HANG_UPS: dict[str, Callable[..., None]] = {
    "half the body sent": _half_the_body,
    "whole request sent, reply never read": _reply_never_read,
    "1 ms client timeout": _one_millisecond_timeout,
    "long-poll abandoned": _long_poll_abandoned,
}


def test_a_client_hanging_up_mid_call_leaves_the_step_whole_and_the_server_serving(server):
    """After each hang-up the run holds that forward_backward entirely or not at all; re-sending it with the
    same idempotency key completes it exactly once, so training goes on exactly as in-process."""
    client = TwinkleClient(server.url, server.keys["carol"])
    run_id = new_run(client, SEED)
    reference = SoloReference(SEED)
    assert client.call(run_id, "forward_only", inputs=EVAL)["loss"] == pytest.approx(reference.eval_loss(EVAL))
    for step, (how, disconnect) in enumerate(HANG_UPS.items()):
        inputs = batch("carol", step, samples=2, length=128)
        body = call_body("forward_backward", f"carol-{step}", inputs=inputs)
        disconnect(server, run_id, body)
        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200, how

        early = client.call(run_id, "calculate_metric", is_training=True)
        assert early["global_step"] == step, how
        assert early.get("num_tokens", 0) in (0, token_count(inputs)), f"{how}: part of a step was applied"
        output = client.resolve(client.request("POST", f"/runs/{run_id}/call", body, retry_safe=True))
        late = client.call(run_id, "calculate_metric", is_training=True)
        applied = early.get("num_tokens", 0) + late.get("num_tokens", 0)
        assert applied == token_count(inputs), f"{how}: the step was applied {applied / token_count(inputs)} times"

        assert output["loss"] == pytest.approx(reference.forward_backward(inputs), abs=1e-5), how
        stepped, expected = client.call(run_id, "clip_grad_and_step"), reference.clip_grad_and_step()
        assert stepped["global_step"] == step + 1, how
        assert stepped["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4), how
        loss = client.call(run_id, "forward_only", inputs=EVAL)["loss"]
        assert loss == pytest.approx(reference.eval_loss(EVAL), abs=1e-5), how
    client.close()
    assert not server.errors(), f"a hang-up is the client's business, not a server error:\n{server.log()[-3000:]}"


def test_abandoned_long_polls_do_not_stall_other_tenants(server):
    """Long-polls a client hung up on wait for their future; they must not hold the threads every tenant's
    short calls need. carol queues slow steps and abandons many long-polls on the last one; bob's short call
    is answered in its turn (the scheduler serves runs round-robin), while carol's last step is still queued."""
    with TwinkleClient(server.url, server.keys["carol"]) as carol, TwinkleClient(server.url, server.keys["bob"]) as bob:
        slow_run, bob_run = new_run(carol, SEED), new_run(bob, SEED)
        slow_steps = [call_body("forward_backward", inputs=batch("slow", i, samples=2, length=300)) for i in range(5)]
        queued = [carol.request("POST", f"/runs/{slow_run}/call", body) for body in slow_steps]
        last = queued[-1]["future_id"]
        for _ in range(48):  # more than the server's worker threads (40)
            hang_up(server.port, "GET", f"/twinkle/v1/futures/{last}?wait=60", server.keys["carol"])
        assert "global_step" in bob.call(bob_run, "calculate_metric", is_training=True)
        status = carol.request("GET", f"/futures/{last}")["status"]
        assert status == "pending", "bob's short call waited until carol's abandoned long-polls ended"
        for reply in queued:
            carol.resolve(reply)


def _post(server, user: str, run_id: str, content: bytes, content_type: str = wire.CONTENT_TYPE) -> httpx.Response:
    headers = {**server.headers(user), "Content-Type": content_type}
    return httpx.post(f"{server.url}/twinkle/v1/runs/{run_id}/call", content=content, headers=headers, timeout=60)


def _bad_requests(feature: dict[str, Any]) -> list[tuple[str, bytes, str, int, str, str]]:
    """``(what, body, content type, status, error type, message part)`` of each bad request."""
    ids = feature["input_ids"]
    good = wire.encode(call_body("forward_backward", inputs=[feature]))

    def fb(inputs: Any, key: str | None = None) -> bytes:
        return wire.encode(call_body("forward_backward", key, inputs=inputs))

    json_type = "application/json"
    return [
        ("truncated wire body", good[:-9], wire.CONTENT_TYPE, 422, "InvalidInputError", "malformed request body"),
        (
            "JSON syntax error",
            b'{"method": "forward_backward", "kwargs": {',
            json_type,
            422,
            "InvalidInputError",
            "malformed request body",
        ),
        ("body not an object", json.dumps([1, 2]).encode(), json_type, 422, "InvalidInputError", "must be an object"),
        (
            "float token ids",
            fb([{"input_ids": [float(i) for i in ids]}]),
            wire.CONTENT_TYPE,
            400,
            "InvalidInputError",
            "inputs[0].input_ids[0] must be an int",
        ),
        (
            "float32 token-id array",
            fb([{"input_ids": np.asarray(ids, dtype=np.float32)}]),
            wire.CONTENT_TYPE,
            400,
            "InvalidInputError",
            "must be an int",
        ),
        (
            "sequence longer than the context",
            fb([{"input_ids": ids * 520}]),
            wire.CONTENT_TYPE,
            400,
            "InvalidInputError",
            "the model's context is 4096",
        ),
        # Twice with one idempotency key: the quota refusal must not leave a future behind for the repeat.
        (
            "over the token quota",
            fb(batch("mallory", 0, samples=3, length=200), "over"),
            wire.CONTENT_TYPE,
            403,
            "QuotaExceededError",
            "max_tokens_per_request",
        ),
        (
            "over the token quota, repeated",
            fb(batch("mallory", 0, samples=3, length=200), "over"),
            wire.CONTENT_TYPE,
            403,
            "QuotaExceededError",
            "max_tokens_per_request",
        ),
    ]


def test_one_tenants_bad_requests_get_4xx_while_two_others_train_as_if_alone(server):
    """mallory sends every kind of bad request over and over while ann and bob train: mallory gets the 4xx
    each deserves and a run nothing touched; ann's and bob's losses equal their solo in-process replays."""
    seeds, steps = {"ann": 21, "bob": 22}, 4
    batches = {user: [batch(user, step, samples=2, length=16) for step in range(steps)] for user in seeds}

    def train(user: str) -> list[float]:
        with TwinkleClient(server.url, server.keys[user]) as client:
            run_id, losses = new_run(client, seeds[user]), []
            for inputs in batches[user]:
                losses.append(client.call(run_id, "forward_backward", inputs=inputs)["loss"])
                client.call(run_id, "clip_grad_and_step")
            return losses

    with TwinkleClient(server.url, server.keys["mallory"]) as mallory, ThreadPoolExecutor(len(seeds)) as pool:
        target = new_run(mallory, SEED)
        training = {user: pool.submit(train, user) for user in seeds}
        rounds = 0
        while rounds < 2 or not all(done.done() for done in training.values()):  # garbage all the while
            for what, content, content_type, status, error_type, part in _bad_requests(batch("ids", rounds)[0]):
                reply = _post(server, "mallory", target, content, content_type)
                assert reply.status_code == status, (what, reply.text)
                error = reply.json()["error"]
                assert error["type"] == error_type and part in error["message"], (what, error)
            rounds += 1
        losses = {user: done.result(timeout=300) for user, done in training.items()}
        untouched = mallory.call(target, "calculate_metric", is_training=True)
    assert "num_tokens" not in untouched and untouched["global_step"] == 0, "a refused call changed the run"
    assert not server.errors(), server.errors()

    model = None
    for user, seed in seeds.items():
        reference = SoloReference(seed, model, name=user)
        model = reference.model
        assert losses[user] == pytest.approx(reference.train(batches[user]), abs=1e-5), user
