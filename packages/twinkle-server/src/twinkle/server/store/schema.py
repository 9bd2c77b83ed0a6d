"""Versioned SQLite schema: ``MIGRATIONS[i]`` takes a database from version ``i`` to ``i + 1``.

The version lives in ``PRAGMA user_version``. Migrations are append-only: a
released entry is never edited, a change is a new entry, so any older database
upgrades in place.
"""

from __future__ import annotations

import sqlite3

from twinkle.errors import ConfigurationError

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE users (name TEXT PRIMARY KEY, created_at REAL NOT NULL)",
        """CREATE TABLE api_keys (
            key_hash TEXT PRIMARY KEY,
            user TEXT NOT NULL REFERENCES users(name),
            prefix TEXT NOT NULL,
            source TEXT NOT NULL CHECK (source IN ('config', 'cli')),
            created_at REAL NOT NULL)""",
        "CREATE INDEX api_keys_user ON api_keys(user)",
        """CREATE TABLE sessions (
            id TEXT PRIMARY KEY,
            user TEXT NOT NULL REFERENCES users(name),
            created_at REAL NOT NULL,
            last_heartbeat REAL NOT NULL,
            closed INTEGER NOT NULL DEFAULT 0)""",
        "CREATE INDEX sessions_open ON sessions(closed, last_heartbeat)",
        """CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            user TEXT NOT NULL REFERENCES users(name),
            session_id TEXT NOT NULL REFERENCES sessions(id),
            lora_config TEXT NOT NULL,
            gradient_accumulation_steps INTEGER NOT NULL,
            created_at REAL NOT NULL,
            resident INTEGER NOT NULL)""",
        "CREATE INDEX runs_user ON runs(user, created_at)",
        "CREATE INDEX runs_session ON runs(session_id)",
        """CREATE TABLE checkpoints (
            run_id TEXT NOT NULL REFERENCES runs(id),
            name TEXT NOT NULL,
            path TEXT NOT NULL,
            created_at REAL NOT NULL,
            PRIMARY KEY (run_id, name))""",
        """CREATE TABLE futures (
            id TEXT PRIMARY KEY,
            user TEXT NOT NULL REFERENCES users(name),
            run_id TEXT REFERENCES runs(id),
            method TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')),
            result BLOB,
            error TEXT,
            idempotency_key TEXT,
            created_at REAL NOT NULL,
            finished_at REAL)""",
        "CREATE INDEX futures_status ON futures(status)",
        """CREATE UNIQUE INDEX futures_idempotency ON futures(user, COALESCE(run_id, ''), idempotency_key)
            WHERE idempotency_key IS NOT NULL""",
    ),
    # Runs that train every weight (lora_config null) or start from a tenant's own checkpoint.
    ("ALTER TABLE runs ADD COLUMN base_model TEXT",),
    # What a client attached to a run (Tinker's user_metadata, LoRA rank and trained modules), as JSON.
    ("ALTER TABLE runs ADD COLUMN metadata TEXT",),
    # Checkpoint TTLs: when a checkpoint expires (epoch seconds), NULL for never; the reaper scans the index.
    (
        "ALTER TABLE checkpoints ADD COLUMN expires_at REAL",
        "CREATE INDEX checkpoints_expiry ON checkpoints(expires_at) WHERE expires_at IS NOT NULL",
    ),
)


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the database to the latest version in one write transaction; returns that version.

    ``BEGIN IMMEDIATE`` takes the write lock before the version is read, so two
    processes opening a fresh database cannot both apply the same migration.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > len(MIGRATIONS):
            raise ConfigurationError(
                f"database schema version {version} is newer than this twinkle-server knows ({len(MIGRATIONS)}); "
                "upgrade twinkle-server"
            )
        for statements in MIGRATIONS[version:]:
            for statement in statements:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {len(MIGRATIONS)}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return len(MIGRATIONS)
