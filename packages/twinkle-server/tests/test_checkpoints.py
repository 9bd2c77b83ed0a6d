"""The checkpoint service: TTLs, the reaper, and files kept while a task reads or writes them."""

from __future__ import annotations

import time

import pytest

from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.services.checkpoints import Checkpoints
from twinkle.server.store import SQLiteStore


@pytest.fixture
def store(tmp_path, clock):
    with SQLiteStore(tmp_path / "twinkle.db", clock=clock) as store:
        store.add_user("alice")
        yield store


@pytest.fixture
def run_id(store):
    return store.create_run("alice", store.create_session("alice").id, {"r": 8}).id


@pytest.fixture
def removed():
    return []


@pytest.fixture
def service(store, tmp_path, removed):
    service = Checkpoints(store, tmp_path / "checkpoints", sweep_interval_s=0.05)
    service.removed_hooks.append(lambda *key: removed.append(key))
    yield service
    service.stop()


def save(service: Checkpoints, run_id: str, name: str, ttl_seconds: float | None = None):
    """What a save does: write the folder while holding the name, then record it."""
    with service.hold_for_save("alice", run_id, name) as directory:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_model.safetensors").write_bytes(b"weights")
        return service.record("alice", run_id, name, str(directory), ttl_seconds), directory


def test_an_expired_checkpoint_is_never_served_and_the_reaper_deletes_it(service, clock, run_id, removed):
    saved, directory = save(service, run_id, "short", ttl_seconds=2)
    kept, _ = save(service, run_id, "kept")
    assert [(c.name, c.expires_at) for c in service.run_checkpoints("alice", run_id)] == [
        ("short", clock.now + 2),
        ("kept", None),
    ]
    assert service.existing("alice", run_id, "short", "short") == saved
    clock.now += 2
    assert service.run_checkpoints("alice", run_id) == [kept]  # gone at once, before any sweep
    for use in (service.existing, service.hold, service.delete):
        with pytest.raises(ResourceNotFoundError, match="no checkpoint 'twinkle://r/short'"):
            use("alice", run_id, "short", "twinkle://r/short")
    assert directory.is_dir()  # until the sweep
    assert service.reap_expired() == 1
    assert not directory.exists() and service.store.expired_checkpoints() == []
    assert not any(path.name.startswith(".deleted") for path in directory.parent.iterdir())
    assert removed == [("alice", run_id, "short")]
    assert service.reap_expired() == 0


def test_a_checkpoint_being_loaded_is_reaped_once_the_load_is_over(service, clock, run_id, removed):
    _, directory = save(service, run_id, "c", ttl_seconds=2)
    hold = service.hold("alice", run_id, "c", "c")
    assert hold.path == directory
    clock.now += 5
    with pytest.raises(ResourceNotFoundError):  # no new reader, though the running one keeps its files
        service.hold("alice", run_id, "c", "c")
    assert service.reap_expired() == 0 and directory.is_dir() and removed == []
    hold.release()
    hold.release()  # releasing twice lets go once
    assert service.reap_expired() == 1 and not directory.exists()


def test_a_save_in_flight_keeps_its_expired_namesake_from_being_reaped(service, clock, run_id):
    _, directory = save(service, run_id, "c", ttl_seconds=2)
    clock.now += 5
    hold = service.hold_for_save("alice", run_id, "c")
    assert service.reap_expired() == 0  # the reaper would otherwise delete the folder being written
    (directory / "adapter_model.safetensors").write_bytes(b"new weights")
    resaved = service.record("alice", run_id, "c", str(directory))
    hold.release()
    assert service.reap_expired() == 0
    assert service.existing("alice", run_id, "c", "c") == resaved and resaved.expires_at is None
    assert (directory / "adapter_model.safetensors").read_bytes() == b"new weights"


def test_deleting_a_checkpoint_being_loaded_removes_its_files_after_the_load(service, run_id, removed):
    _, directory = save(service, run_id, "c")
    with service.hold("alice", run_id, "c", "c"):
        service.delete("alice", run_id, "c", "c")
        assert service.get("alice", run_id, "c") is None
        assert directory.is_dir() and removed == []
    assert not directory.exists() and removed == [("alice", run_id, "c")]
    _, directory = save(service, run_id, "d")
    service.delete("alice", run_id, "d", "d")  # nobody holds it: gone at once
    assert not directory.exists()


def test_a_resave_after_a_deferred_delete_keeps_the_new_files(service, run_id):
    _, directory = save(service, run_id, "c")
    reader = service.hold("alice", run_id, "c", "c")
    service.delete("alice", run_id, "c", "c")
    save(service, run_id, "c")
    reader.release()
    assert directory.is_dir() and service.get("alice", run_id, "c") is not None


def test_a_ttl_is_set_from_now_cleared_and_bad_values_change_nothing(service, clock, run_id):
    save(service, run_id, "c", ttl_seconds=60)
    clock.now += 10
    assert service.set_ttl("alice", run_id, "c", 2, "c").expires_at == clock.now + 2
    for bad in (-1, 0, "soon", [5]):
        with pytest.raises(InvalidInputError, match="ttl_seconds must be"):
            service.set_ttl("alice", run_id, "c", bad, "c")
    assert service.get("alice", run_id, "c").expires_at == clock.now + 2
    assert service.set_ttl("alice", run_id, "c", None, "c").expires_at is None
    with pytest.raises(ResourceNotFoundError, match="no checkpoint 'twinkle://r/missing'"):
        service.set_ttl("alice", run_id, "missing", 5, "twinkle://r/missing")
    with pytest.raises(InvalidInputError, match="ttl_seconds must be > 0"):
        service.record("alice", run_id, "d", "/d", -5)
    assert [c.name for c in service.run_checkpoints("alice", run_id)] == ["c"]


def test_the_background_reaper_sweeps_until_stopped(service, clock, run_id):
    _, directory = save(service, run_id, "c", ttl_seconds=2)
    service.start()
    clock.now += 2
    deadline = time.monotonic() + 10
    while directory.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not directory.exists()
    service.stop()
    _, directory = save(service, run_id, "d", ttl_seconds=2)
    clock.now += 2
    time.sleep(0.2)  # four sweep intervals: a stopped reaper deletes nothing
    assert directory.is_dir()
