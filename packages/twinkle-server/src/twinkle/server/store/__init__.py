"""Durable server state behind one interface: ``Store`` (records + ownership rules) and ``SQLiteStore``."""

from twinkle.server.store.base import (
    Checkpoint,
    Future,
    FutureStatus,
    Run,
    Session,
    Store,
    User,
    check_ttl_seconds,
    check_user_name,
    new_id,
)
from twinkle.server.store.sqlite import SQLiteStore

__all__ = [
    "Checkpoint",
    "Future",
    "FutureStatus",
    "Run",
    "SQLiteStore",
    "Session",
    "Store",
    "User",
    "check_ttl_seconds",
    "check_user_name",
    "new_id",
]
