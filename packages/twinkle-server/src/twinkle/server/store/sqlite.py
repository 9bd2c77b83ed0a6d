"""``SQLiteStore``: the embedded default ``Store`` (stdlib sqlite3, one file, WAL).

One connection guarded by a lock serves every thread of the server: each
statement takes microseconds, so serialising them costs nothing next to a model
step, and it rules out "database is locked" between our own threads. WAL plus a
busy timeout lets another process (``twinkle server add-user`` while the server
runs) read and write the same file safely. Writes use ``BEGIN IMMEDIATE`` so a
read-then-write (an ownership check, then the update) is atomic across processes.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from twinkle.errors import ConfigurationError, InvalidInputError, ResourceNotFoundError
from twinkle.server.store import rows
from twinkle.server.store.base import (
    INFLIGHT_STATUSES,
    Checkpoint,
    Future,
    KeySource,
    Run,
    Session,
    Store,
    User,
    check_ttl_seconds,
    check_user_name,
    new_id,
)
from twinkle.server.store.schema import migrate

_INFLIGHT = "('" + "', '".join(INFLIGHT_STATUSES) + "')"
# A checkpoint whose TTL has not run out (the parameter is now); an expired one is never returned.
_LIVE = "(expires_at IS NULL OR expires_at > ?)"


class SQLiteStore(Store):
    """A ``Store`` in the SQLite file ``path`` (created, and migrated to the latest schema, on open)."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path).expanduser()
        self._clock = clock
        self._lock = threading.RLock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigurationError(f"cannot open the server database {self.path}: {exc}") from exc
        try:
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut may lose, never corrupt
            self._conn.execute("PRAGMA foreign_keys=ON")
            migrate(self._conn)
        except BaseException as exc:
            self._conn.close()
            if isinstance(exc, sqlite3.Error):  # e.g. the file is not a database
                raise ConfigurationError(f"cannot use the server database {self.path}: {exc}") from exc
            raise

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                if self._conn.in_transaction:  # some errors (disk full) already rolled back
                    self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _rows(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def _row(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Row | None:
        found = self._rows(sql, params)
        return found[0] if found else None

    def _update(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._tx() as conn:
            return conn.execute(sql, params).rowcount

    # users and keys
    def add_user(self, name: str) -> User:
        check_user_name(name)
        with self._tx() as conn:
            conn.execute("INSERT OR IGNORE INTO users VALUES (?, ?)", (name, self._clock()))
            return rows.user(conn.execute("SELECT * FROM users WHERE name = ?", (name,)).fetchone())

    def get_user(self, name: str) -> User | None:
        row = self._row("SELECT * FROM users WHERE name = ?", (name,))
        return rows.user(row) if row else None

    def add_api_key(self, user: str, key_hash: str, prefix: str, source: KeySource = "cli") -> None:
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM users WHERE name = ?", (user,)).fetchone() is None:
                raise ResourceNotFoundError(f"no user {user!r}; create it first")
            if conn.execute("SELECT 1 FROM api_keys WHERE key_hash = ?", (key_hash,)).fetchone():
                raise InvalidInputError(f"API key {prefix}... is already registered")
            conn.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, ?)", (key_hash, user, prefix, source, self._clock()))

    def user_for_key_hash(self, key_hash: str) -> str | None:
        row = self._row("SELECT user FROM api_keys WHERE key_hash = ?", (key_hash,))
        return row["user"] if row else None

    def sync_config_keys(self, keys: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        now = self._clock()
        with self._tx() as conn:
            conn.execute("DELETE FROM api_keys WHERE source = 'config'")
            for user, pairs in keys.items():
                conn.execute("INSERT OR IGNORE INTO users VALUES (?, ?)", (check_user_name(user), now))
                for key_hash, prefix in pairs:
                    owner = conn.execute("SELECT user FROM api_keys WHERE key_hash = ?", (key_hash,)).fetchone()
                    if owner is not None and owner["user"] != user:
                        raise ConfigurationError(
                            f"config key {prefix}... of user {user!r} was already issued to user {owner['user']!r}"
                        )
                    conn.execute(
                        "INSERT OR IGNORE INTO api_keys VALUES (?, ?, ?, 'config', ?)", (key_hash, user, prefix, now)
                    )

    # sessions
    def create_session(self, user: str) -> Session:
        now = self._clock()
        session = Session(new_id("ses"), user, now, now, closed=False)
        with self._tx() as conn:
            conn.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, 0)", (session.id, user, now, now))
        return session

    def get_session(self, user: str, session_id: str) -> Session | None:
        row = self._row("SELECT * FROM sessions WHERE id = ? AND user = ?", (session_id, user))
        return rows.session(row) if row else None

    def heartbeat(self, user: str, session_id: str) -> bool:
        sql = "UPDATE sessions SET last_heartbeat = ? WHERE id = ? AND user = ? AND closed = 0"
        return self._update(sql, (self._clock(), session_id, user)) == 1

    def close_session(self, user: str, session_id: str) -> list[str] | None:
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM sessions WHERE id = ? AND user = ?", (session_id, user)).fetchone() is None:
                return None
            conn.execute("UPDATE sessions SET closed = 1 WHERE id = ?", (session_id,))
            found = conn.execute(
                "SELECT id FROM runs WHERE session_id = ? AND resident = 1 ORDER BY created_at", (session_id,)
            ).fetchall()
            conn.execute("UPDATE runs SET resident = 0 WHERE session_id = ?", (session_id,))
        return [row["id"] for row in found]

    def stale_sessions(self, heartbeat_before: float) -> list[Session]:
        found = self._rows("SELECT * FROM sessions WHERE closed = 0 AND last_heartbeat < ?", (heartbeat_before,))
        return [rows.session(row) for row in found]

    # runs
    def create_run(
        self,
        user: str,
        session_id: str,
        lora_config: dict[str, Any] | None,
        gradient_accumulation_steps: int = 1,
        base_model: str | None = None,
        run_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Run | None:
        if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int):
            raise InvalidInputError(f"gradient_accumulation_steps must be an int, got {gradient_accumulation_steps!r}")
        if gradient_accumulation_steps < 1:
            raise InvalidInputError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        config_json = rows.to_json(lora_config, "lora_config")
        metadata_json = rows.to_json(dict(metadata or {}), "metadata")
        run = Run(
            run_id or new_id("run"),
            user,
            session_id,
            json.loads(config_json),
            gradient_accumulation_steps,
            self._clock(),
            True,
            base_model,
            json.loads(metadata_json),
        )
        with self._tx() as conn:
            if not _open_session(conn, user, session_id):
                return None
            if conn.execute("SELECT 1 FROM runs WHERE id = ?", (run.id,)).fetchone():
                raise InvalidInputError(f"run id {run.id!r} is taken")
            conn.execute(
                "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, 1, ?, ?)",
                (
                    run.id,
                    user,
                    session_id,
                    config_json,
                    gradient_accumulation_steps,
                    run.created_at,
                    base_model,
                    metadata_json,
                ),
            )
        return run

    def get_run(self, user: str, run_id: str) -> Run | None:
        row = self._row("SELECT * FROM runs WHERE id = ? AND user = ?", (run_id, user))
        return rows.run(row) if row else None

    def list_runs(self, user: str) -> list[Run]:
        return [
            rows.run(row) for row in self._rows("SELECT * FROM runs WHERE user = ? ORDER BY created_at, rowid", (user,))
        ]

    def count_resident_runs(self, user: str) -> int:
        return self._rows("SELECT COUNT(*) FROM runs WHERE user = ? AND resident = 1", (user,))[0][0]

    def set_resident(self, user: str, run_id: str, resident: bool, session_id: str | None = None) -> bool:
        with self._tx() as conn:
            if session_id is not None and not _open_session(conn, user, session_id):
                return False
            sql = "UPDATE runs SET resident = ?, session_id = COALESCE(?, session_id) WHERE id = ? AND user = ?"
            return conn.execute(sql, (int(resident), session_id, run_id, user)).rowcount == 1

    def mark_all_runs_nonresident(self) -> int:
        return self._update("UPDATE runs SET resident = 0 WHERE resident = 1")

    # checkpoints
    def add_checkpoint(
        self, user: str, run_id: str, name: str, path: str, ttl_seconds: float | None = None
    ) -> Checkpoint | None:
        ttl = check_ttl_seconds(ttl_seconds)
        now = self._clock()
        checkpoint = Checkpoint(run_id, name, str(path), now, None if ttl is None else now + ttl)
        with self._tx() as conn:
            if not _owns_run(conn, user, run_id):
                return None
            conn.execute(
                "INSERT INTO checkpoints (run_id, name, path, created_at, expires_at) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, name) DO UPDATE SET "
                "path = excluded.path, created_at = excluded.created_at, expires_at = excluded.expires_at",
                (run_id, name, checkpoint.path, checkpoint.created_at, checkpoint.expires_at),
            )
        return checkpoint

    def get_checkpoint(self, user: str, run_id: str, name: str) -> Checkpoint | None:
        row = self._row(
            "SELECT c.* FROM checkpoints c JOIN runs r ON r.id = c.run_id "
            f"WHERE c.run_id = ? AND c.name = ? AND r.user = ? AND {_LIVE}",
            (run_id, name, user, self._clock()),
        )
        return rows.checkpoint(row) if row else None

    def list_checkpoints(self, user: str, run_id: str) -> list[Checkpoint] | None:
        with self._lock:
            if not _owns_run(self._conn, user, run_id):
                return None
            found = self._rows(
                f"SELECT * FROM checkpoints WHERE run_id = ? AND {_LIVE} ORDER BY created_at, rowid",
                (run_id, self._clock()),
            )
        return [rows.checkpoint(row) for row in found]

    def set_checkpoint_ttl(self, user: str, run_id: str, name: str, ttl_seconds: float | None) -> Checkpoint | None:
        ttl = check_ttl_seconds(ttl_seconds)
        with self._tx() as conn:
            now = self._clock()
            changed = conn.execute(
                f"UPDATE checkpoints SET expires_at = ? WHERE run_id = ? AND name = ? AND {_LIVE} "
                "AND run_id IN (SELECT id FROM runs WHERE user = ?)",
                (None if ttl is None else now + ttl, run_id, name, now, user),
            ).rowcount
            if changed != 1:
                return None
            row = conn.execute("SELECT * FROM checkpoints WHERE run_id = ? AND name = ?", (run_id, name)).fetchone()
        return rows.checkpoint(row)

    def delete_checkpoint(self, user: str, run_id: str, name: str) -> bool:
        sql = (
            f"DELETE FROM checkpoints WHERE run_id = ? AND name = ? AND {_LIVE} "
            "AND run_id IN (SELECT id FROM runs WHERE user = ?)"
        )
        return self._update(sql, (run_id, name, self._clock(), user)) == 1

    def expired_checkpoints(self) -> list[tuple[str, Checkpoint]]:
        found = self._rows(
            "SELECT r.user AS owner, c.* FROM checkpoints c JOIN runs r ON r.id = c.run_id "
            "WHERE c.expires_at <= ? ORDER BY c.expires_at, c.rowid",
            (self._clock(),),
        )
        return [(row["owner"], rows.checkpoint(row)) for row in found]

    def delete_expired_checkpoint(self, user: str, run_id: str, name: str) -> bool:
        sql = (
            "DELETE FROM checkpoints WHERE run_id = ? AND name = ? AND expires_at <= ? "
            "AND run_id IN (SELECT id FROM runs WHERE user = ?)"
        )
        return self._update(sql, (run_id, name, self._clock(), user)) == 1

    # futures
    def create_future(
        self,
        user: str,
        method: str,
        run_id: str | None = None,
        idempotency_key: str | None = None,
        future_id: str | None = None,
    ) -> tuple[Future, bool]:
        with self._tx() as conn:
            if run_id is not None and not _owns_run(conn, user, run_id):
                raise ResourceNotFoundError(f"run {run_id!r} not found")
            if idempotency_key is not None:
                row = conn.execute(
                    "SELECT * FROM futures WHERE user = ? AND COALESCE(run_id, '') = COALESCE(?, '') "
                    "AND idempotency_key = ?",
                    (user, run_id, idempotency_key),
                ).fetchone()
                if row is not None:
                    return rows.future(row), False
            future = Future(
                future_id or new_id("fut"), user, run_id, method, "pending", None, None, self._clock(), None
            )
            conn.execute(
                "INSERT INTO futures (id, user, run_id, method, status, idempotency_key, created_at) "
                "VALUES (?, ?, ?, ?, 'pending', ?, ?)",
                (future.id, user, run_id, method, idempotency_key, future.created_at),
            )
        return future, True

    def get_future(self, user: str, future_id: str) -> Future | None:
        row = self._row("SELECT * FROM futures WHERE id = ? AND user = ?", (future_id, user))
        return rows.future(row) if row else None

    def start_future(self, future_id: str) -> bool:
        sql = "UPDATE futures SET status = 'running' WHERE id = ? AND status = 'pending'"
        return self._update(sql, (future_id,)) == 1

    def finish_future(self, future_id: str, result: bytes) -> float | None:
        return self._finish(future_id, "done", "result", sqlite3.Binary(result))

    def fail_future(self, future_id: str, error: dict[str, Any]) -> float | None:
        return self._finish(future_id, "failed", "error", rows.to_json(error, "error"))

    def _finish(self, future_id: str, status: str, column: str, value: Any) -> float | None:
        sql = f"UPDATE futures SET status = ?, {column} = ?, finished_at = ? WHERE id = ? AND status IN {_INFLIGHT}"
        now = self._clock()
        return now if self._update(sql, (status, value, now, future_id)) == 1 else None

    def mark_inflight_futures_failed(self, reason: str) -> int:
        error = json.dumps({"type": "ServerError", "message": reason})
        return self._update(
            f"UPDATE futures SET status = 'failed', error = ?, finished_at = ? WHERE status IN {_INFLIGHT}",
            (error, self._clock()),
        )

    def purge_futures(self, finished_before: float) -> int:
        return self._update("DELETE FROM futures WHERE finished_at < ?", (finished_before,))

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _owns_run(conn: sqlite3.Connection, user: str, run_id: str) -> bool:
    return conn.execute("SELECT 1 FROM runs WHERE id = ? AND user = ?", (run_id, user)).fetchone() is not None


def _open_session(conn: sqlite3.Connection, user: str, session_id: str) -> bool:
    query = "SELECT 1 FROM sessions WHERE id = ? AND user = ? AND closed = 0"
    return conn.execute(query, (session_id, user)).fetchone() is not None
