"""Converting between SQLite rows and the ``Store`` records (JSON columns, 0/1 flags, blobs)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.server.store.base import Checkpoint, Future, Run, Session, User


def to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{what} must be JSON-serialisable: {exc}") from exc


def user(row: sqlite3.Row) -> User:
    return User(row["name"], row["created_at"])


def session(row: sqlite3.Row) -> Session:
    return Session(row["id"], row["user"], row["created_at"], row["last_heartbeat"], bool(row["closed"]))


def run(row: sqlite3.Row) -> Run:
    return Run(
        row["id"],
        row["user"],
        row["session_id"],
        json.loads(row["lora_config"]),
        row["gradient_accumulation_steps"],
        row["created_at"],
        bool(row["resident"]),
        row["base_model"],
        json.loads(row["metadata"] or "{}"),
    )


def checkpoint(row: sqlite3.Row) -> Checkpoint:
    return Checkpoint(row["run_id"], row["name"], row["path"], row["created_at"], row["expires_at"])


def future(row: sqlite3.Row) -> Future:
    error = json.loads(row["error"]) if row["error"] is not None else None
    result = bytes(row["result"]) if row["result"] is not None else None
    return Future(
        row["id"],
        row["user"],
        row["run_id"],
        row["method"],
        row["status"],
        result,
        error,
        row["created_at"],
        row["finished_at"],
    )
