"""cookbook/client/server/{transformer,megatron}/: seed 004's server configurations and start scripts, used as a
user uses them.

The config is checked for what it serves; ``run.sh`` then starts the server from it (with a free port and
a private state folder given as flags), a user created with ``twinkle server add-user`` against the same
config calls both APIs, and the server is stopped. On the Megatron back-end (``use_megatron: true``) two
users train LoRA adapters at once, in shared passes over one megatron-core base (``MultiLoraMegatronModel``):
each gets the losses and the saved adapter of its adapter trained alone on an in-process ``MegatronModel``
(float32, 1e-5), and a sample with its adapter has the log-probs that model gives the sampled tokens. A
Tinker SDK client trains beside them with Tinker's default LoRA (the output layer's too): its untrained
adapter's log-probs are the base model's, and two steps lower its loss.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
import torch
from safetensors.torch import load_file

from twinkle.model import TargetSequence
from twinkle.server.config import check_config, load_config
from twinkle_client.http import TwinkleClient

sys.path.insert(0, str(Path(__file__).parent))
from harness import SoloReference, batch, new_run
from tinker_harness import BASE_MODEL, logprobs_of, sft_datum

pytestmark = pytest.mark.integration

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook" / "client" / "server" / "transformer"
CONFIG = COOKBOOK / "server_config.yaml"
MEGATRON = COOKBOOK.parent / "megatron"
START_TIMEOUT_S = 120.0
STEPS = 3
TENANTS = {"ann": 1, "bob": 2}  # user -> the adapter's seed


def test_the_config_serves_the_embedded_model_on_this_machine_only():
    assert check_config(CONFIG) == []
    config = load_config(CONFIG)
    assert (config.model_id, config.host, config.port) == ("builtin://qwen3-tiny", "127.0.0.1", 8000)
    assert (config.device, config.max_loras, config.replicas, config.ray) == ("cpu", 8, 1, False)
    assert config.quotas.max_adapters == 4


def test_run_sh_starts_the_server_from_the_config_and_both_apis_answer(tmp_path, monkeypatch):
    state_dir = tmp_path / "state"
    key = _add_user(CONFIG, state_dir, "me")
    monkeypatch.setenv("PYTHON", sys.executable)
    log = tmp_path / "server.log"
    server, url = _start(COOKBOOK, state_dir, log)
    try:
        _wait_until_healthy(url, server, log)
        tinker = httpx.get(f"{url}/api/v1/get_server_capabilities", headers={"Authorization": f"Bearer {key}"})
        assert tinker.status_code == 200, tinker.text
        assert [m["model_name"] for m in tinker.json()["supported_models"]] == ["builtin://qwen3-tiny"]
        with TwinkleClient(url, key) as client:
            info = client.server_info()
            assert (info["base_model"], info["max_loras"]) == ("builtin://qwen3-tiny", 8)
            assert client.list_runs() == []
    finally:
        server.terminate()
        server.wait(timeout=60)
    # A clean shutdown on SIGTERM (uvicorn exits by the signal once it has shut the application down).
    assert server.returncode in (0, -signal.SIGTERM), log.read_text()[-3000:]
    assert "Application shutdown complete" in log.read_text()


def test_the_megatron_server_trains_tenants_in_shared_passes_as_each_alone(tmp_path, monkeypatch):
    megatron = pytest.importorskip("twinkle.model.megatron", reason="needs twinkle-model[megatron]")
    config = MEGATRON / "server_config.yaml"
    assert check_config(config) == []
    assert (load_config(config).backend, load_config(config).model_id) == ("megatron", "builtin://qwen3-tiny")
    state_dir = tmp_path / "state"
    keys = {user: _add_user(config, state_dir, user) for user in (*TENANTS, "tinker")}
    monkeypatch.setenv("PYTHON", sys.executable)
    log = tmp_path / "server.log"
    server, url = _start(MEGATRON, state_dir, log)
    results: dict[str, dict[str, Any]] = {}
    try:
        _wait_until_healthy(url, server, log)
        threads = [threading.Thread(target=_train, args=(url, keys[user], user, results)) for user in TENANTS]
        for thread in threads:
            thread.start()
        _train_with_tinker(url, keys["tinker"], results)
        for thread in threads:
            thread.join(timeout=600)
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert set(results) == {*TENANTS, "tinker"}, log.read_text()[-3000:]
    shared = re.findall(r'^twinkle_shared_pass_calls_total\{[^}]*api="twinkle"[^}]*\} (\S+)$', metrics, re.M)
    assert sum(map(float, shared)) > 0, "no call ran in a pass with the other tenant's"
    reference = megatron.MegatronModel(device="cpu")
    for user, seed in TENANTS.items():
        solo = SoloReference(seed, model=reference, name=user)
        losses = solo.train([batch(user, step, samples=2) for step in range(STEPS)])
        assert results[user]["losses"] == pytest.approx(losses, abs=1e-5), user
        saved = load_file(str(state_dir / "checkpoints" / user / results[user]["path"] / "adapter_model.safetensors"))
        for name, tensor in solo.model.adapter_state_dict(solo.model.train_state(user)).items():
            torch.testing.assert_close(saved[name], tensor.detach(), rtol=1e-5, atol=1e-5, msg=f"{user}: {name}")
        sequence = results[user]["sample"]
        logps = solo.model.forward_only([sequence["new_input_feature"]], adapter_name=user).logps[0]
        prompt = len(sequence["new_input_feature"]["input_ids"]) - len(sequence["tokens"])
        assert logps[prompt:].tolist() == pytest.approx(sequence["logprobs"], abs=1e-4), user
    tinker_run = results["tinker"]
    reference.add_adapter_to_model("untrained", {"r": 4, "target_modules": ["q_proj", "lm_head"]})  # B = 0: the base
    sequence = TargetSequence(torch.tensor(tinker_run["tokens"]), torch.tensor(tinker_run["targets"]))
    base = reference.forward_backward_targets([sequence], adapter_name="untrained", backward=False).logps[0]
    assert list(tinker_run["before"]) == pytest.approx(base.tolist(), abs=1e-5)
    assert tinker_run["losses"][1] < tinker_run["losses"][0]


def _train_with_tinker(url: str, key: str, results: dict[str, dict[str, Any]]) -> None:
    """Tinker's default LoRA adapter: its log-probs before training, then two steps' losses."""
    client = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4)
        datum = sft_datum(7)
        before = logprobs_of(trainer.forward([datum], "cross_entropy").result())[0]
        losses = []
        for _step in range(2):
            losses.append(trainer.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            trainer.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    finally:
        client.close("success").result(timeout=30)
    tokens = datum.model_input.to_ints()
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    results["tinker"] = {"before": before, "losses": losses, "tokens": tokens, "targets": targets}


def _train(url: str, key: str, user: str, results: dict[str, dict[str, Any]]) -> None:
    """``STEPS`` of LoRA SFT as ``user``, a checkpoint, and a greedy sample with the trained adapter."""
    with TwinkleClient(url, key) as client:
        run_id = new_run(client, TENANTS[user])
        losses = []
        for step in range(STEPS):
            losses.append(client.call(run_id, "forward_backward", inputs=batch(user, step, samples=2))["loss"])
            client.call(run_id, "clip_grad_and_step")
        path = client.call(run_id, "save", name="final")
        body = {"run_id": run_id, "inputs": batch(user, 99)[0], "sampling_params": {"max_tokens": 4, "temperature": 0}}
        sample = client.resolve(client.request("POST", "/sample", body))["sequences"][0]
    results[user] = {"losses": losses, "path": path.removeprefix("twinkle://"), "sample": sample}  # run/name


def _add_user(config: Path, state_dir: Path, user: str) -> str:
    """``twinkle server add-user``: the new API key."""
    command = [sys.executable, "-m", "twinkle.cli", "server", "add-user", user, "--config", str(config)]
    command += ["--state-dir", str(state_dir)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def _start(cookbook: Path, state_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """``run.sh`` of ``cookbook`` on a free port, writing to ``log``; the process and its URL."""
    port = _free_port()
    with log.open("w") as output:
        server = subprocess.Popen(
            ["bash", str(cookbook / "run.sh"), "--port", str(port), "--state-dir", str(state_dir)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    return server, f"http://127.0.0.1:{port}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"the server did not start within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
