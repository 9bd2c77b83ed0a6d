"""A server with ``sampler: vllm``: tenants train, then sample their own adapters on the vLLM engine (CPU build).

One ``twinkle server`` process (127.0.0.1, stopped at the end) serves two
tenants: alice over the native API (samples her run's live adapter), bob over
the Tinker API with the unmodified ``tinker`` SDK (samples the checkpoint
``save_weights_for_sampler`` wrote). Each one's sampled log-probs equal the
server trainer's forward of the same tokens with that tenant's adapter (1e-5,
float32), and not with the other's. ``make test-vllm`` runs it.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in .venv-vllm")
tinker = pytest.importorskip("tinker")

import httpx  # noqa: E402
import yaml  # noqa: E402

from twinkle.data_format import IGNORE_INDEX, SamplingParams, make_input_feature  # noqa: E402
from twinkle_client.http import TwinkleClient  # noqa: E402
from twinkle_client.sampler import sample_body, sample_request  # noqa: E402

MODEL = "builtin://qwen3-tiny-head32"  # vLLM's CPU attention needs heads >= 32 wide
ATOL = 1e-5
KEYS = {user: f"tml-{user}-key-0123456789abcdef" for user in ("alice", "bob")}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
PROMPT = [151644, 872, 198, 3838, 374, 220, 17, 10, 18, 30, 151645, 198, 151644, 77091, 198]
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    state_dir = tmp_path_factory.mktemp("vllm-server")
    config = {
        "model_id": MODEL,
        "state_dir": str(state_dir),
        "max_loras": 4,
        "max_rank": 8,
        "apis": ["tinker"],
        "sampler": "vllm",
        "sampler_args": {
            "engine_args": {
                "dtype": "float32",
                "max_model_len": 1024,
                "kv_cache_memory_bytes": 128 << 20,
                "enforce_eager": True,
            }
        },
        "users": {user: {"api_keys": [key]} for user, key in KEYS.items()},
    }
    (state_dir / "server.yaml").write_text(yaml.safe_dump(config))
    port, log = free_port(), state_dir / "server.log"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "twinkle.cli", "server", "--config", str(state_dir / "server.yaml")]
    with log.open("w") as out:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(process, url, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _wait_until_up(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)
    raise RuntimeError(f"the server did not start within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def batch(seed: int, samples: int = 2, length: int = 12) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    features = []
    for _ in range(samples):
        ids = [rng.randrange(100, 5000) for _ in range(length)]
        features.append(make_input_feature(ids, [IGNORE_INDEX, *ids[1:]]))
    return features


def native_forward(client: TwinkleClient, run_id: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """The server trainer's log-probs of ``tokens`` after ``prompt`` with the run's adapter."""
    feature = make_input_feature(prompt + tokens, [IGNORE_INDEX] * len(prompt) + tokens)
    logps = client.call(run_id, "forward_only", inputs=[feature])["logps"][0]
    return [float(value) for value in logps[len(prompt) :]]


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def alice(server: str) -> Iterator[tuple[TwinkleClient, str]]:
    """alice's run, trained natively: two forward_backward + clip_grad_and_step steps."""
    client = TwinkleClient(server, api_key=KEYS["alice"])
    run_id = client.create_run(LORA, seed=1)
    client.call(run_id, "set_optimizer", optimizer_cls="AdamW", lr=5e-2)
    for step in range(2):
        client.call(run_id, "forward_backward", inputs=batch(step))
        client.call(run_id, "clip_grad_and_step")
    yield client, run_id
    client.close()


@pytest.fixture(scope="module")
def bob(server: str) -> Iterator[tuple[Any, Any]]:
    """bob's LoRA, trained over the Tinker API, and a sampling client on its ``save_weights_for_sampler`` checkpoint."""
    from tinker import types

    service = tinker.ServiceClient(base_url=server, api_key=KEYS["bob"])
    # vLLM puts no LoRA on the output layer (see vLLMSampler), so bob's adapter leaves it out
    training = service.create_lora_training_client(base_model=MODEL, rank=4, seed=2, train_unembed=False)
    rng = random.Random(7)
    for _ in range(2):
        tokens = [rng.randrange(100, 5000) for _ in range(13)]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 12},
        )
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampling = training.save_weights_and_get_sampling_client("bob-v1")
    yield training, sampling
    service.close("success").result(timeout=30)


def tinker_forward(training: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    from tinker import types

    sequence = prompt + tokens
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(sequence[:-1]),
        loss_fn_inputs={"target_tokens": sequence[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(tokens)},
    )
    logprobs = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return [float(value) for value in logprobs.tolist()[len(prompt) - 1 :]]


def test_native_sampling_of_a_run_gives_its_trainers_logprobs(alice):
    client, run_id = alice
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    response = sample_request(client, sample_body([{"input_ids": PROMPT}], params, run_id, num_samples=2))
    for sequence in response.sequences:
        difference = gap(sequence.logprobs, native_forward(client, run_id, PROMPT, list(sequence.tokens)))
        print(f"native (alice's run): max |dlogp| {difference:.2e}")
        assert difference <= ATOL


def test_tinker_sampling_of_a_checkpoint_gives_its_trainers_logprobs(bob):
    from tinker import types

    training, sampling = bob
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    result = sampling.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=params)
    for sequence in result.result().sequences:
        difference = gap(list(sequence.logprobs), tinker_forward(training, PROMPT, list(sequence.tokens)))
        print(f"tinker (bob's checkpoint): max |dlogp| {difference:.2e}")
        assert difference <= ATOL


def test_two_tenants_sample_their_own_adapters(alice, bob):
    """The same tokens scored by the other tenant's trainer differ: neither samples the other's adapter."""
    from tinker import types

    client, run_id = alice
    training, sampling = bob
    greedy = SamplingParams(max_tokens=8, temperature=0)
    alices = sample_request(client, sample_body([{"input_ids": PROMPT}], greedy, run_id)).sequences[0]
    tinker_greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    bobs = sampling.sample(types.ModelInput.from_ints(PROMPT), 1, tinker_greedy).result().sequences[0]
    alice_tokens, bob_tokens = list(alices.tokens), list(bobs.tokens)
    assert gap(alices.logprobs, native_forward(client, run_id, PROMPT, alice_tokens)) <= ATOL
    assert gap(list(bobs.logprobs), tinker_forward(training, PROMPT, bob_tokens)) <= ATOL
    cross_alice = gap(alices.logprobs, tinker_forward(training, PROMPT, alice_tokens))
    cross_bob = gap(list(bobs.logprobs), native_forward(client, run_id, PROMPT, bob_tokens))
    print(f"alice's sample under bob's adapter: {cross_alice:.2e}; bob's under alice's: {cross_bob:.2e}")
    assert cross_alice > 1e-2 and cross_bob > 1e-2
