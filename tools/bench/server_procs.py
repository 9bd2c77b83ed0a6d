"""The ``twinkle server`` processes of ``server.py``: started on 127.0.0.1, checked with ``ss``, always stopped."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

MODEL_ID = "builtin://qwen3-tiny"


class Server:
    """A ``twinkle server`` subprocess with the given users (name: API key); :meth:`stop` ends it."""

    def __init__(self, name: str, root: Path, users: dict[str, str], threads: int, **options: Any) -> None:
        self.name = name
        self.keys = users
        state_dir = root / name
        state_dir.mkdir(parents=True)
        config = {
            "model_id": MODEL_ID,
            "state_dir": str(state_dir),
            "quotas": {"requests_per_second": 1000},
            "users": {user: {"api_keys": [key]} for user, key in users.items()},
            **options,
        }
        (state_dir / "server.yaml").write_text(json.dumps(config))  # JSON is YAML
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = state_dir / "server.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        command = [sys.executable, "-m", "twinkle.cli", "server", "--config", str(state_dir / "server.yaml")]
        with open(self.log_path, "w") as log:  # a file, not a pipe: uvicorn logs every request
            self.process = subprocess.Popen(
                [*command, "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server {self.name!r} exited {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"server {self.name!r} did not answer /healthz within {timeout:.0f} s:\n{self.log_tail()}")

    def listening(self) -> list[str]:
        """The local addresses this server process listens on, from ``ss -tnlp``."""
        output = subprocess.run(["ss", "-tnlp"], capture_output=True, text=True, check=True).stdout
        return [line.split()[3] for line in output.splitlines() if f"pid={self.process.pid}," in line]

    def counters(self) -> tuple[float, float, float]:
        """From ``/metrics``: ``(sum, count)`` of the requests per shared pass so far, and the model's busy seconds."""
        wanted = (
            "twinkle_shared_pass_requests_sum",
            "twinkle_shared_pass_requests_count",
            "twinkle_model_busy_seconds",
        )
        values = dict.fromkeys(wanted, 0.0)
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            name, _, value = line.partition(" ")
            if name in values:
                values[name] = float(value)
        total, count, busy = (values[name] for name in wanted)
        return total, count, busy

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_loopback_only(server: Server) -> None:
    """Fail unless ``ss -tnlp`` shows the server listening on 127.0.0.1 only."""
    if shutil.which("ss") is None:
        print(f"  server {server.name!r}: 'ss' is not installed, cannot check where it listens")
        return
    addresses = server.listening()
    if not addresses or any(not address.startswith("127.0.0.1:") for address in addresses):
        raise RuntimeError(f"server {server.name!r} (pid {server.process.pid}) listens on {addresses}")
    print(f"  server {server.name!r}: pid {server.process.pid}, ss -tnlp: listening on {', '.join(addresses)} only")


@contextlib.contextmanager
def started_servers(root: Path, args: argparse.Namespace) -> Iterator[dict[str, Server]]:
    """Both servers, started together; stopped when the block ends, whatever happens in it."""
    tenants = [f"{kind}{i}" for kind in ("native", "tinker") for i in range(8)]
    users = {user: f"tml-{secrets.token_hex(16)}" for user in ("bench", *tenants)}
    slots = {"max_loras": len(tenants)}  # every tenant's adapter stays resident (part (1)'s is freed first)
    servers: dict[str, Server] = {}
    try:
        servers["batched"] = Server("batched", root, users, args.threads, **slots)
        servers["one-at-a-time"] = Server("one-at-a-time", root, users, args.threads, max_tokens_per_pass=0, **slots)
        for server in servers.values():
            server.wait_ready()
            check_loopback_only(server)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
