"""The server's durable state: records and the ``Store`` interface every back-end implements.

Ownership is part of the interface: every lookup of a user-owned record takes
the user, and another user's id behaves exactly like an unknown one (``None`` /
``False``), so no route can leak a row by forgetting a check. Raw API keys
never reach the store; it only sees their hashes.
"""

from __future__ import annotations

import math
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from twinkle.errors import InvalidInputError

FutureStatus = Literal["pending", "running", "done", "failed"]
INFLIGHT_STATUSES: tuple[FutureStatus, ...] = ("pending", "running")
KeySource = Literal["config", "cli"]

_USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_TTL_S = 10 * 365 * 24 * 3600.0  # Tinker's upper bound for a checkpoint's time to live (10 years)


def check_user_name(name: str) -> str:
    """``name`` if it can name a user (it also becomes a folder name under the checkpoint root)."""
    if not _USER_NAME.fullmatch(name) or ".." in name:
        raise InvalidInputError(
            f"invalid user name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return name


def check_ttl_seconds(ttl_seconds: Any) -> float | None:
    """``ttl_seconds`` as a float if it can be a checkpoint's time to live (None: kept until deleted)."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, (int, float)):
        raise InvalidInputError(
            f"ttl_seconds must be a number of seconds (or null to keep the checkpoint), got {ttl_seconds!r}"
        )
    if not (math.isfinite(ttl_seconds) and 0 < ttl_seconds <= MAX_TTL_S):
        raise InvalidInputError(f"ttl_seconds must be > 0 and at most {MAX_TTL_S:.0f} (10 years), got {ttl_seconds}")
    return float(ttl_seconds)


def new_id(prefix: str) -> str:
    """An unguessable id such as ``run-Xb3...``: ids are capabilities within a user, so they must not be enumerable."""
    return f"{prefix}-{secrets.token_urlsafe(16)}"


@dataclass(frozen=True)
class User:
    name: str
    created_at: float


@dataclass(frozen=True)
class Session:
    id: str
    user: str
    created_at: float
    last_heartbeat: float
    closed: bool


@dataclass(frozen=True)
class Checkpoint:
    """A saved checkpoint of a run; ``expires_at`` (epoch seconds) is when its TTL runs out, None for never."""

    run_id: str
    name: str
    path: str
    created_at: float
    expires_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The wire form of ``GET /runs/{run_id}/checkpoints`` entries."""
        return {"name": self.name, "path": self.path, "created_at": self.created_at, "expires_at": self.expires_at}


@dataclass(frozen=True)
class Run:
    """A training run; ``resident`` says whether its adapter (or model) is loaded right now.

    ``lora_config`` is None for a run that trains every weight; ``base_model`` is the
    ``twinkle://`` checkpoint a run starts from, None for the server's base model;
    ``metadata`` is what the client attached (e.g. Tinker's ``user_metadata``).
    """

    id: str
    user: str
    session_id: str
    lora_config: dict[str, Any] | None
    gradient_accumulation_steps: int
    created_at: float
    resident: bool
    base_model: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, checkpoints: Sequence[Checkpoint] = ()) -> dict[str, Any]:
        """The wire form of ``GET /runs/{run_id}``."""
        return {
            "run_id": self.id,
            "user": self.user,
            "lora_config": self.lora_config,
            "base_model": self.base_model,
            "created_at": self.created_at,
            "resident": self.resident,
            "checkpoints": [checkpoint.to_dict() for checkpoint in checkpoints],
        }


@dataclass(frozen=True)
class Future:
    """A long-running call; ``result`` is the encoded value (opaque to the store), ``error`` ``{"type", "message"}``."""

    id: str
    user: str
    run_id: str | None
    method: str
    status: FutureStatus
    result: bytes | None
    error: dict[str, Any] | None
    created_at: float
    finished_at: float | None


class Store(ABC):
    """Users, API-key hashes, sessions, runs, checkpoints and futures; thread-safe."""

    # users and keys
    @abstractmethod
    def add_user(self, name: str) -> User:
        """Create ``name`` (validated by ``check_user_name``), or return it if it exists."""

    @abstractmethod
    def get_user(self, name: str) -> User | None: ...

    @abstractmethod
    def add_api_key(self, user: str, key_hash: str, prefix: str, source: KeySource = "cli") -> None:
        """Record a key hash for an existing ``user``; ``prefix`` is the few characters safe to display."""

    @abstractmethod
    def user_for_key_hash(self, key_hash: str) -> str | None: ...

    @abstractmethod
    def sync_config_keys(self, keys: Mapping[str, Sequence[tuple[str, str]]]) -> None:
        """Make the config-sourced keys exactly ``{user: [(hash, prefix)]}``, creating users as needed.

        A key deleted from the config stops working at the next start; CLI-issued keys are kept.
        """

    # sessions
    @abstractmethod
    def create_session(self, user: str) -> Session: ...

    @abstractmethod
    def get_session(self, user: str, session_id: str) -> Session | None: ...

    @abstractmethod
    def heartbeat(self, user: str, session_id: str) -> bool:
        """Refresh an open session; False when it is unknown, another user's or closed."""

    @abstractmethod
    def close_session(self, user: str, session_id: str) -> list[str] | None:
        """Close the session and make its runs non-resident; the ids of runs that were resident, None if unknown."""

    @abstractmethod
    def stale_sessions(self, heartbeat_before: float) -> list[Session]:
        """Open sessions (of every user) whose last heartbeat is older than ``heartbeat_before``."""

    # runs
    @abstractmethod
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
        """A new resident run; None when ``session_id`` is not an open session of ``user``.

        ``run_id`` defaults to a new unguessable ``run-`` id; a given one that exists raises InvalidInputError.
        """

    @abstractmethod
    def get_run(self, user: str, run_id: str) -> Run | None: ...

    @abstractmethod
    def list_runs(self, user: str) -> list[Run]:
        """``user``'s runs, oldest first."""

    @abstractmethod
    def count_resident_runs(self, user: str) -> int: ...

    @abstractmethod
    def set_resident(self, user: str, run_id: str, resident: bool, session_id: str | None = None) -> bool:
        """Mark a run (not) in the adapter pool, moving it to ``session_id`` (an open session of ``user``) if given."""

    @abstractmethod
    def mark_all_runs_nonresident(self) -> int:
        """At start-up the adapter pool is empty whatever the database says; returns how many runs changed."""

    # checkpoints: one whose TTL ran out is never returned, whether or not it was deleted yet
    @abstractmethod
    def add_checkpoint(
        self, user: str, run_id: str, name: str, path: str, ttl_seconds: float | None = None
    ) -> Checkpoint | None:
        """Record (or replace, as a re-save replaces the folder) checkpoint ``name``; None if the run is unknown.

        With ``ttl_seconds`` (checked by ``check_ttl_seconds``) it expires that long after now; a re-save
        without one keeps it until deleted.
        """

    @abstractmethod
    def get_checkpoint(self, user: str, run_id: str, name: str) -> Checkpoint | None: ...

    @abstractmethod
    def list_checkpoints(self, user: str, run_id: str) -> list[Checkpoint] | None:
        """The run's checkpoints, oldest first; None if the run is unknown."""

    @abstractmethod
    def set_checkpoint_ttl(self, user: str, run_id: str, name: str, ttl_seconds: float | None) -> Checkpoint | None:
        """Make the checkpoint expire ``ttl_seconds`` from now, or never (None); None if there is no such checkpoint."""

    @abstractmethod
    def delete_checkpoint(self, user: str, run_id: str, name: str) -> bool: ...

    @abstractmethod
    def expired_checkpoints(self) -> list[tuple[str, Checkpoint]]:
        """``(user, checkpoint)`` of every checkpoint (of every user) whose TTL has run out, soonest expired first."""

    @abstractmethod
    def delete_expired_checkpoint(self, user: str, run_id: str, name: str) -> bool:
        """Delete the checkpoint if it is still expired (not re-saved or given a new TTL since); True if it was."""

    # futures
    @abstractmethod
    def create_future(
        self,
        user: str,
        method: str,
        run_id: str | None = None,
        idempotency_key: str | None = None,
        future_id: str | None = None,
    ) -> tuple[Future, bool]:
        """``(future, created)``: a repeated ``idempotency_key`` for the same user and run returns the first future.

        ``future_id`` lets a caller that also tracks futures in memory keep one id; by default a new ``fut-`` id.
        Raises ResourceNotFoundError if ``run_id`` is not ``user``'s run.
        """

    @abstractmethod
    def get_future(self, user: str, future_id: str) -> Future | None: ...

    @abstractmethod
    def start_future(self, future_id: str) -> bool:
        """pending → running; False if the future is not pending."""

    @abstractmethod
    def finish_future(self, future_id: str, result: bytes) -> float | None:
        """→ done; returns its ``finished_at``, or None if the future already finished (e.g. failed by a restart)."""

    @abstractmethod
    def fail_future(self, future_id: str, error: dict[str, Any]) -> float | None:
        """→ failed with ``{"type", "message"}``; returns its ``finished_at``, or None if it already finished."""

    @abstractmethod
    def mark_inflight_futures_failed(self, reason: str) -> int:
        """Fail every pending/running future with a ``ServerError`` naming ``reason``; used at start-up."""

    @abstractmethod
    def purge_futures(self, finished_before: float) -> int:
        """Delete futures finished before that time (their results can be large); returns how many."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
