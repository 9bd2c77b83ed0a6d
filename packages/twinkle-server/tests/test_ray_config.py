"""``twinkle server --ray --replicas N``: the options, their validation and the flags (no Ray started here)."""

from pathlib import Path

import pytest

from twinkle.errors import ConfigurationError
from twinkle.server import cli
from twinkle.server.config import check_config, load_config
from twinkle.server.services.engine import PoolTask


def test_ray_and_replicas_from_the_file_and_from_flags(tmp_path: Path):
    path = tmp_path / "server.yaml"
    path.write_text("ray: true\nreplicas: 3\n")
    assert check_config(path) == []
    config = load_config(path)
    assert (config.ray, config.replicas) == (True, 3)
    assert (load_config(path, replicas=2).replicas, load_config().ray, load_config().replicas) == (2, False, 1)


def test_replicas_need_ray_and_must_be_positive(tmp_path: Path):
    path = tmp_path / "server.yaml"
    path.write_text("replicas: 2\n")
    assert check_config(path) == ["replicas: 2 replicas need ray: true (or --ray)"]
    path.write_text("ray: true\nreplicas: 0\n")
    assert check_config(path) == ["replicas: must be positive, got 0"]
    path.write_text("ray: yes please\n")
    assert check_config(path) == ["ray: expected bool, got str ('yes please')"]
    with pytest.raises(ConfigurationError, match="need ray"):
        load_config(replicas=2)


def test_cli_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch):
    seen = {}
    monkeypatch.setattr("twinkle.server.application.run_server", lambda config: seen.setdefault("config", config))
    assert cli.main(["--ray", "--replicas", "2", "--state-dir", "/tmp/twinkle-ray-cli"]) == 0
    assert (seen["config"].ray, seen["config"].replicas) == (True, 2)
    assert cli.main(["--replicas", "2", "--state-dir", "/tmp/twinkle-ray-cli"]) == 1  # reported, not raised


def test_pool_tasks_are_data():
    class Pool:
        def add(self, a: int, b: int) -> int:
            return a + b

    task = PoolTask("add", (1, 2))
    assert task.apply(Pool()) == 3
    assert task == PoolTask("add", (1, 2))  # compared and pickled by value: it crosses to the replicas
