import threading
import time
from pathlib import Path

import pytest

from twinkle.hub.cache import cache_root, materialize


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TWINKLE_CACHE_DIR", str(tmp_path))
    return tmp_path


def write_marker(target: Path) -> None:
    (target / "data.txt").write_text("ok")


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TWINKLE_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv("TWINKLE_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "twinkle"


def test_materialize_builds_once_and_then_reuses(cache):
    calls = []

    def build(target: Path) -> None:
        calls.append(target)
        write_marker(target)

    first = materialize("thing-v1", build)
    second = materialize("thing-v1", build)
    assert first == second == cache / "builtin" / "thing-v1"
    assert (first / "data.txt").read_text() == "ok"
    assert len(calls) == 1
    assert calls[0] != first, "the build must write into a staging directory, not the final one"


def test_a_new_version_gets_its_own_directory(cache):
    assert materialize("thing-v1", write_marker) != materialize("thing-v2", write_marker)


def test_a_failed_build_leaves_no_directory_behind(cache):
    def crash(target: Path) -> None:
        write_marker(target)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        materialize("thing-v1", crash)
    assert [p.name for p in (cache / "builtin").iterdir() if not p.name.endswith(".lock")] == []
    assert (materialize("thing-v1", write_marker) / "data.txt").exists()


def test_staging_left_by_a_killed_builder_is_cleaned_up(cache):
    abandoned = cache / "builtin" / ".thing-v1.tmp-dead"
    abandoned.mkdir(parents=True)
    (abandoned / "half.bin").write_bytes(b"\0")
    materialize("thing-v1", write_marker)
    assert not abandoned.exists()


def test_concurrent_callers_build_once(cache):
    calls = []

    def slow_build(target: Path) -> None:
        calls.append(target)
        time.sleep(0.2)
        write_marker(target)

    results = []
    threads = [threading.Thread(target=lambda: results.append(materialize("thing-v1", slow_build))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(set(results)) == 1 and len(results) == 4
