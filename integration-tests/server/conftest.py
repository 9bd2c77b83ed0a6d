"""The real ``twinkle server`` process for the server tests: start, kill, restart, read its log and memory.

Servers bind 127.0.0.1 on a free port and log to a file (a pipe nobody reads
would fill up and block the server under load). Every server a module starts is
stopped when the module ends.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def api_key(user: str) -> str:
    """A deterministic key for ``user`` (configured keys must be at least 16 characters)."""
    return f"tml-{user}-key-0123456789abcdef"


@dataclass
class ServerProcess:
    """One ``python -m twinkle.cli server`` process on a fixed port and state dir (so it can be restarted)."""

    config: Path
    state_dir: Path
    log_path: Path
    keys: dict[str, str]
    args: list[str] = field(default_factory=list)  # further ``twinkle server`` flags (``--ray``)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "the server is not running"
        return self.process.pid

    def start(self) -> None:
        """Start the server (again, after ``kill``) and wait until ``/healthz`` answers."""
        with self.log_path.open("a") as log:
            log.write(f"----- start {time.strftime('%H:%M:%S')}\n")
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "twinkle.cli",
                    "server",
                    "--config",
                    str(self.config),
                    "--port",
                    str(self.port),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError(f"the server did not start within {START_TIMEOUT_S} s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as when the machine or the OOM killer stops it."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def errors(self) -> list[str]:
        """Log lines of server errors: a 5xx answered, a traceback, anything logged at ERROR."""
        return [line for line in self.log().splitlines() if re.search(r'" 5\d\d |Traceback|ERROR', line)]

    def rss_kib(self) -> int:
        """Resident memory of the server process (``VmRSS`` in ``/proc/<pid>/status``)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError(f"no VmRSS for process {self.pid}")

    def metric(self, name: str) -> float:
        """One unlabelled sample of the Prometheus ``/metrics`` page."""
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise KeyError(f"no metric {name!r} on {self.url}/metrics")

    def headers(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[user]}"}


@pytest.fixture(scope="module")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """``start_server(users, user_quotas=None, args=None, **settings)``: a running server, one API key per user.

    Keys are :func:`api_key`'s; ``user_quotas`` maps a user to its quota overrides; ``settings`` are further
    top-level config keys (``max_loras``, ``quotas``, ...); ``args`` further command-line flags.
    """
    servers: list[ServerProcess] = []

    def start(
        users: list[str],
        user_quotas: dict[str, dict[str, Any]] | None = None,
        args: list[str] | None = None,
        **settings: Any,
    ) -> ServerProcess:
        state_dir = tmp_path_factory.mktemp("server")
        keys = {user: api_key(user) for user in users}
        quotas = user_quotas or {}
        config = {
            "state_dir": str(state_dir),
            "users": {user: {"api_keys": [key], "quotas": quotas.get(user, {})} for user, key in keys.items()},
            **settings,
        }
        config_path = state_dir / "server.yaml"
        config_path.write_text(yaml.safe_dump(config))
        server = ServerProcess(config_path, state_dir, state_dir / "server.log", keys, list(args or []))
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()
