import sqlite3
import threading

import pytest

from twinkle.errors import ConfigurationError, InvalidInputError, ResourceNotFoundError
from twinkle.server.store import SQLiteStore
from twinkle.server.store.schema import MIGRATIONS


@pytest.fixture
def store(tmp_path, clock):
    with SQLiteStore(tmp_path / "state" / "twinkle.db", clock=clock) as store:
        store.add_user("alice")
        store.add_user("bob")
        yield store


def test_schema_is_versioned_and_wal(tmp_path):
    path = tmp_path / "twinkle.db"
    SQLiteStore(path).close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    conn.commit()
    conn.close()
    with pytest.raises(ConfigurationError, match=rf"schema version {len(MIGRATIONS) + 1} is newer .* upgrade"):
        SQLiteStore(path)


def test_unusable_database_names_the_path(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError, match=r"cannot open the server database .*file/twinkle\.db"):
        SQLiteStore(tmp_path / "file" / "twinkle.db")
    (tmp_path / "text.db").write_text("not a database, just text that is long enough to have a header" * 20)
    with pytest.raises(ConfigurationError, match=r"cannot use the server database .*text\.db: file is not a database"):
        SQLiteStore(tmp_path / "text.db")


def test_users_are_idempotent_and_validated(store):
    assert store.add_user("alice") == store.get_user("alice")
    assert store.get_user("carol") is None
    for bad in ("", "../x", "a/b", "-x", "x" * 65, "a..b"):
        with pytest.raises(InvalidInputError, match="invalid user name"):
            store.add_user(bad)


def test_api_keys_map_hash_to_user(store):
    store.add_api_key("alice", "h1", "tml-abcd")
    assert store.user_for_key_hash("h1") == "alice"
    assert store.user_for_key_hash("h2") is None
    with pytest.raises(InvalidInputError, match=r"tml-abcd\.\.\. is already registered"):
        store.add_api_key("bob", "h1", "tml-abcd")
    with pytest.raises(ResourceNotFoundError, match="no user 'carol'"):
        store.add_api_key("carol", "h3", "tml-efgh")


def test_sync_config_keys_replaces_only_config_keys(store):
    store.add_api_key("alice", "cli-hash", "tml-cli")
    store.sync_config_keys({"alice": [("cfg-1", "k1")], "carol": [("cfg-2", "k2")]})
    assert store.get_user("carol") is not None
    assert [store.user_for_key_hash(h) for h in ("cli-hash", "cfg-1", "cfg-2")] == ["alice", "alice", "carol"]
    store.sync_config_keys({"alice": [("cfg-3", "k3")]})
    assert store.user_for_key_hash("cfg-1") is None  # removed from the config: revoked
    assert store.user_for_key_hash("cfg-2") is None
    assert store.user_for_key_hash("cfg-3") == "alice"
    assert store.user_for_key_hash("cli-hash") == "alice"  # add-user keys survive
    with pytest.raises(ConfigurationError, match="of user 'bob' was already issued to user 'alice'"):
        store.sync_config_keys({"bob": [("cli-hash", "tml-cli")]})
    assert store.user_for_key_hash("cfg-3") == "alice"  # the failed sync changed nothing


def test_sessions_heartbeat_close_and_staleness(store, clock):
    session = store.create_session("alice")
    assert session.id.startswith("ses-") and not session.closed
    clock.now += 50
    assert store.heartbeat("alice", session.id)
    assert store.get_session("alice", session.id).last_heartbeat == 1050
    other = store.create_session("bob")
    clock.now += 100
    assert [s.id for s in store.stale_sessions(heartbeat_before=clock.now - 60)] == [session.id, other.id]
    assert store.close_session("alice", session.id) == []
    assert store.get_session("alice", session.id).closed
    assert not store.heartbeat("alice", session.id)
    assert [s.id for s in store.stale_sessions(heartbeat_before=clock.now)] == [other.id]


def test_runs_lifecycle(store):
    session = store.create_session("alice")
    run = store.create_run("alice", session.id, {"r": 8, "target_modules": "all-linear"}, 4)
    assert run.id.startswith("run-") and run.resident
    assert store.get_run("alice", run.id) == run
    second = store.create_run("alice", session.id, {"r": 4})
    assert [r.id for r in store.list_runs("alice")] == [run.id, second.id]
    assert store.count_resident_runs("alice") == 2
    assert sorted(store.close_session("alice", session.id)) == sorted([run.id, second.id])
    assert store.count_resident_runs("alice") == 0
    assert store.create_run("alice", session.id, {"r": 8}) is None  # closed session
    new_session = store.create_session("alice")
    assert not store.set_resident("alice", run.id, True, session_id=session.id)  # closed session
    assert store.set_resident("alice", run.id, True, session_id=new_session.id)
    resumed = store.get_run("alice", run.id)
    assert resumed.resident and resumed.session_id == new_session.id
    assert resumed.to_dict() == {
        "run_id": run.id,
        "user": "alice",
        "lora_config": {"r": 8, "target_modules": "all-linear"},
        "base_model": None,
        "created_at": run.created_at,
        "resident": True,
        "checkpoints": [],
    }
    assert store.mark_all_runs_nonresident() == 1
    assert not store.get_run("alice", run.id).resident


def test_run_arguments_are_validated(store):
    session = store.create_session("alice")
    with pytest.raises(InvalidInputError, match="gradient_accumulation_steps must be >= 1, got 0"):
        store.create_run("alice", session.id, {}, 0)
    with pytest.raises(InvalidInputError, match="lora_config must be JSON-serialisable"):
        store.create_run("alice", session.id, {"r": object()})


def test_checkpoints(store, clock):
    session = store.create_session("alice")
    run = store.create_run("alice", session.id, {"r": 8})
    assert store.list_checkpoints("alice", run.id) == []
    store.add_checkpoint("alice", run.id, "step-1", "/ckpt/step-1")
    clock.now += 1
    store.add_checkpoint("alice", run.id, "step-2", "/ckpt/step-2")
    clock.now += 1
    resaved = store.add_checkpoint("alice", run.id, "step-1", "/ckpt/step-1b")
    names = [(c.name, c.path) for c in store.list_checkpoints("alice", run.id)]
    assert names == [("step-2", "/ckpt/step-2"), ("step-1", "/ckpt/step-1b")]
    assert store.get_checkpoint("alice", run.id, "step-1") == resaved
    assert resaved.to_dict() == {"name": "step-1", "path": "/ckpt/step-1b", "created_at": clock.now, "expires_at": None}
    assert store.delete_checkpoint("alice", run.id, "step-1")
    assert not store.delete_checkpoint("alice", run.id, "step-1")
    assert store.get_checkpoint("alice", run.id, "step-1") is None


def test_a_checkpoint_with_a_ttl_is_listed_with_its_expiry_and_never_returned_after_it(store, clock):
    session = store.create_session("alice")
    run = store.create_run("alice", session.id, {"r": 8})
    saved = store.add_checkpoint("alice", run.id, "short", "/short", ttl_seconds=2)
    store.add_checkpoint("alice", run.id, "kept", "/kept")
    assert saved.expires_at == clock.now + 2
    assert store.get_checkpoint("alice", run.id, "short") == saved
    assert [(c.name, c.expires_at) for c in store.list_checkpoints("alice", run.id)] == [
        ("short", clock.now + 2),
        ("kept", None),
    ]
    assert store.expired_checkpoints() == []
    clock.now += 2  # the TTL has run out: gone for every reader, though the record is still there
    assert store.get_checkpoint("alice", run.id, "short") is None
    assert [c.name for c in store.list_checkpoints("alice", run.id)] == ["kept"]
    assert store.set_checkpoint_ttl("alice", run.id, "short", 100) is None  # too late to extend it
    assert not store.delete_checkpoint("alice", run.id, "short")  # the reaper's to delete, with its files
    assert store.expired_checkpoints() == [("alice", saved)]
    assert not store.delete_expired_checkpoint("bob", run.id, "short")  # another user's id is an unknown one
    assert store.delete_expired_checkpoint("alice", run.id, "short")
    assert store.expired_checkpoints() == []
    assert not store.delete_expired_checkpoint("alice", run.id, "kept")  # it never expires


def test_a_checkpoints_ttl_can_be_set_cleared_and_reset_by_a_resave(store, clock):
    session = store.create_session("alice")
    run = store.create_run("alice", session.id, {"r": 8})
    store.add_checkpoint("alice", run.id, "c", "/c")
    clock.now += 10
    assert store.set_checkpoint_ttl("alice", run.id, "c", 5).expires_at == clock.now + 5  # from now, not the save
    assert store.set_checkpoint_ttl("bob", run.id, "c", 5) is None
    assert store.set_checkpoint_ttl("alice", run.id, "missing", 5) is None
    assert store.set_checkpoint_ttl("alice", run.id, "c", None).expires_at is None
    store.set_checkpoint_ttl("alice", run.id, "c", 1)
    clock.now += 0.5
    resaved = store.add_checkpoint("alice", run.id, "c", "/c2")  # a re-save without a TTL keeps it
    clock.now += 1
    assert store.get_checkpoint("alice", run.id, "c") == resaved and resaved.expires_at is None
    assert store.expired_checkpoints() == []


@pytest.mark.parametrize(
    "ttl, message",
    [
        (-1, "must be > 0 .*, got -1"),
        (0, "must be > 0 .*, got 0"),
        (float("nan"), "must be > 0 .*, got nan"),
        (float("inf"), "must be > 0 .*, got inf"),
        (11 * 365 * 24 * 3600, r"must be > 0 and at most 315360000 \(10 years\), got 346896000"),
        ("60", r"must be a number of seconds \(or null to keep the checkpoint\), got '60'"),
        (True, "must be a number of seconds .*, got True"),
    ],
)
def test_bad_ttls_are_refused_and_change_nothing(store, ttl, message):
    session = store.create_session("alice")
    run = store.create_run("alice", session.id, {"r": 8})
    kept = store.add_checkpoint("alice", run.id, "c", "/c", ttl_seconds=60)
    with pytest.raises(InvalidInputError, match=f"ttl_seconds {message}"):
        store.add_checkpoint("alice", run.id, "d", "/d", ttl_seconds=ttl)
    with pytest.raises(InvalidInputError, match=f"ttl_seconds {message}"):
        store.set_checkpoint_ttl("alice", run.id, "c", ttl)
    assert store.list_checkpoints("alice", run.id) == [kept]


def test_a_version_3_database_gains_checkpoint_expiry(tmp_path):
    path = tmp_path / "twinkle.db"
    conn = sqlite3.connect(path)
    for statements in MIGRATIONS[:3]:
        for statement in statements:
            conn.execute(statement)
    conn.execute("INSERT INTO users VALUES ('alice', 0)")
    conn.execute("INSERT INTO sessions VALUES ('ses-1', 'alice', 0, 0, 0)")
    conn.execute("""INSERT INTO runs VALUES ('run-1', 'alice', 'ses-1', '{"r": 4}', 1, 0, 1, NULL, NULL)""")
    conn.execute("INSERT INTO checkpoints VALUES ('run-1', 'old', '/old', 0)")
    conn.execute("PRAGMA user_version = 3")
    conn.commit()
    conn.close()
    with SQLiteStore(path) as store:
        (old,) = store.list_checkpoints("alice", "run-1")
        assert (old.name, old.expires_at) == ("old", None)  # saved before TTLs: kept until deleted


def test_futures_lifecycle_and_idempotency(store, clock):
    session = store.create_session("alice")
    run = store.create_run("alice", session.id, {"r": 8})
    future, created = store.create_future("alice", "forward_backward", run.id, idempotency_key="k1")
    assert created and future.id.startswith("fut-") and future.status == "pending"
    again, created = store.create_future("alice", "forward_backward", run.id, idempotency_key="k1")
    assert not created and again.id == future.id
    assert store.create_future("alice", "forward_backward", run.id, idempotency_key="k2")[1]
    assert store.create_future("bob", "sample", idempotency_key="k1")[1]  # keys are per user and run
    assert not store.create_future("bob", "sample", idempotency_key="k1")[1]  # also without a run
    assert store.create_future("alice", "sample", future_id="fut-mine")[0].id == "fut-mine"
    assert store.start_future(future.id)
    assert not store.start_future(future.id)
    clock.now += 2
    assert store.finish_future(future.id, b"\x00TWK1 payload") == 1002  # when it finished
    done = store.get_future("alice", future.id)
    assert (done.status, done.result, done.error, done.finished_at) == ("done", b"\x00TWK1 payload", None, 1002)
    assert store.fail_future(future.id, {"type": "ServerError", "message": "late"}) is None  # already finished
    failing, _ = store.create_future("alice", "step", run.id)
    assert store.fail_future(failing.id, {"type": "InvalidInputError", "message": "bad batch"}) == 1002
    assert store.get_future("alice", failing.id).error == {"type": "InvalidInputError", "message": "bad batch"}
    with pytest.raises(ResourceNotFoundError, match=f"run '{run.id}' not found"):
        store.create_future("bob", "forward", run.id)
    clock.now += 100
    assert store.purge_futures(finished_before=clock.now) == 2
    assert store.get_future("alice", future.id) is None


def test_ownership_isolation(store):
    session = store.create_session("alice")
    run = store.create_run("alice", session.id, {"r": 8})
    store.add_checkpoint("alice", run.id, "c1", "/c1")
    future, _ = store.create_future("alice", "forward", run.id)
    assert store.get_session("bob", session.id) is None
    assert not store.heartbeat("bob", session.id)
    assert store.close_session("bob", session.id) is None
    assert store.create_run("bob", session.id, {"r": 8}) is None
    assert store.get_run("bob", run.id) is None
    assert store.list_runs("bob") == []
    assert not store.set_resident("bob", run.id, False)
    assert store.add_checkpoint("bob", run.id, "evil", "/evil") is None
    assert store.list_checkpoints("bob", run.id) is None
    assert store.get_checkpoint("bob", run.id, "c1") is None
    assert not store.delete_checkpoint("bob", run.id, "c1")
    assert store.get_future("bob", future.id) is None
    assert store.get_run("alice", run.id).resident  # nothing bob did touched alice's state
    assert [c.name for c in store.list_checkpoints("alice", run.id)] == ["c1"]


def test_state_persists_across_reopen_and_inflight_futures_fail(tmp_path):
    path = tmp_path / "twinkle.db"
    with SQLiteStore(path) as store:
        store.add_user("alice")
        store.add_api_key("alice", "hash", "tml-abcd")
        session = store.create_session("alice")
        run = store.create_run("alice", session.id, {"r": 8})
        store.add_checkpoint("alice", run.id, "c1", "/c1")
        pending, _ = store.create_future("alice", "forward", run.id)
        running, _ = store.create_future("alice", "step", run.id)
        store.start_future(running.id)
        done, _ = store.create_future("alice", "save", run.id)
        store.finish_future(done.id, b"ok")
    with SQLiteStore(path) as store:  # "the server restarted"
        assert store.user_for_key_hash("hash") == "alice"
        assert store.get_run("alice", run.id).lora_config == {"r": 8}
        assert store.get_checkpoint("alice", run.id, "c1").path == "/c1"
        assert store.mark_inflight_futures_failed("the server restarted while this call was running") == 2
        for future_id in (pending.id, running.id):
            future = store.get_future("alice", future_id)
            assert future.status == "failed"
            assert future.error == {
                "type": "ServerError",
                "message": "the server restarted while this call was running",
            }
        assert store.get_future("alice", done.id).result == b"ok"


def test_concurrent_writes_from_threads_and_a_second_connection(tmp_path):
    path = tmp_path / "twinkle.db"
    store, other_process = SQLiteStore(path), SQLiteStore(path)
    store.add_user("alice")
    session = store.create_session("alice")
    errors: list[BaseException] = []

    def work(db: SQLiteStore, worker: int) -> None:
        try:
            for i in range(25):
                run = db.create_run("alice", session.id, {"r": 8, "worker": worker, "i": i})
                future, _ = db.create_future("alice", "forward", run.id, idempotency_key=f"{worker}-{i}")
                db.start_future(future.id)
                db.finish_future(future.id, bytes([worker, i]))
                db.heartbeat("alice", session.id)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(store if w % 2 else other_process, w)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    runs = store.list_runs("alice")
    assert len(runs) == 200 and len({r.id for r in runs}) == 200
    assert {(r.lora_config["worker"], r.lora_config["i"]) for r in runs} == {
        (w, i) for w in range(8) for i in range(25)
    }
    assert store.count_resident_runs("alice") == 200
    store.close()
    other_process.close()


def test_a_version_1_database_upgrades_in_place_and_keeps_its_runs(tmp_path):
    from twinkle.server.store.schema import MIGRATIONS

    path = tmp_path / "twinkle.db"
    conn = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("INSERT INTO users VALUES ('alice', 0)")
    conn.execute("INSERT INTO sessions VALUES ('ses-1', 'alice', 0, 0, 0)")
    conn.execute("""INSERT INTO runs VALUES ('run-1', 'alice', 'ses-1', '{"r": 4}', 1, 0, 1)""")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    store = SQLiteStore(path)
    (run,) = store.list_runs("alice")
    assert run.lora_config == {"r": 4} and run.base_model is None
    store.close()
