"""cookbook/client/server/transformer/: seed 004's server configuration and start scripts, used as a user uses them.

The config is checked for what it serves; ``run.sh`` then starts the server from it (with a free port and
a private state folder given as flags), a user created with ``twinkle server add-user`` against the same
config calls both APIs, and the server is stopped.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from twinkle.server.config import check_config, load_config
from twinkle_client.http import TwinkleClient

pytestmark = pytest.mark.integration

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook" / "client" / "server" / "transformer"
CONFIG = COOKBOOK / "server_config.yaml"
START_TIMEOUT_S = 120.0


def test_the_config_serves_the_embedded_model_on_this_machine_only():
    assert check_config(CONFIG) == []
    config = load_config(CONFIG)
    assert (config.model_id, config.host, config.port) == ("builtin://qwen3-tiny", "127.0.0.1", 8000)
    assert (config.device, config.max_loras, config.replicas, config.ray) == ("cpu", 8, 1, False)
    assert config.quotas.max_adapters == 4


def test_run_sh_starts_the_server_from_the_config_and_both_apis_answer(tmp_path, monkeypatch):
    state_dir, port = tmp_path / "state", _free_port()
    twinkle = [sys.executable, "-m", "twinkle.cli", "server"]
    add_user = [*twinkle, "add-user", "me", "--config", str(CONFIG), "--state-dir", str(state_dir)]
    key = subprocess.run(add_user, capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setenv("PYTHON", sys.executable)
    log = tmp_path / "server.log"
    with log.open("w") as output:
        server = subprocess.Popen(
            ["bash", str(COOKBOOK / "run.sh"), "--port", str(port), "--state-dir", str(state_dir)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
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
