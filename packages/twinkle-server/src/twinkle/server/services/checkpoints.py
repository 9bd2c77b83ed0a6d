"""Runs' checkpoints, for both APIs: their folders, records, time to live, and the reaper of expired ones.

A checkpoint saved with a TTL is listed with its expiry until then. Once the TTL
runs out the store never returns it, so nothing serves it even between sweeps;
the reaper, a background thread started and stopped with the server, then
deletes its record and folder every ``sweep_interval_s``.

Files are never removed under a task that reads or writes them: a load, a
sampler loading the adapter, or a save *holds* its checkpoint from the request
until the task is over. The reaper leaves a held checkpoint to a later sweep,
and an explicit delete forgets the record at once (nothing new can open it) but
removes the folder only when the last holder lets go.
"""

from __future__ import annotations

import secrets
import shutil
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from twinkle.errors import ConfigurationError, ResourceNotFoundError
from twinkle.server.paths import safe_child
from twinkle.server.store import Checkpoint, Store
from twinkle.utils import get_logger

logger = get_logger(__name__)

CheckpointKey = tuple[str, str, str]  # (user, run id, checkpoint name)


class CheckpointHold:
    """A checkpoint kept on disk while a task uses its folder ``path``; ``release`` it (once or more) when done."""

    def __init__(self, checkpoints: Checkpoints, key: CheckpointKey, path: Path) -> None:
        self.path = path
        self._checkpoints, self._key = checkpoints, key
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._checkpoints._release(self._key)

    def __enter__(self) -> Path:
        return self.path

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Checkpoints:
    """The checkpoints under ``root`` (``<user>/<run>/<name>``) recorded in ``store``."""

    def __init__(self, store: Store, root: str | Path, sweep_interval_s: float = 60.0) -> None:
        self.store = store
        self.root = Path(root)
        self.sweep_interval_s = sweep_interval_s
        # Called with (user, run id, name) once a checkpoint is gone (deleted or expired, and no task holds it).
        self.removed_hooks: list[Callable[[str, str, str], None]] = []
        self._holds: Counter[CheckpointKey] = Counter()
        self._deleted_while_held: set[CheckpointKey] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    def directory(self, user: str, run_id: str, name: str) -> Path:
        """Where checkpoint ``name`` of the run lives (Tinker's sampler weights are ``sampler_weights/<name>``)."""
        return safe_child(self.root, user, run_id, *name.split("/"))

    def get(self, user: str, run_id: str, name: str) -> Checkpoint | None:
        return self.store.get_checkpoint(user, run_id, name)

    def run_checkpoints(self, user: str, run_id: str) -> list[Checkpoint] | None:
        """The run's live checkpoints, oldest first; None if the run is not ``user``'s."""
        return self.store.list_checkpoints(user, run_id)

    def existing(self, user: str, run_id: str, name: str, shown: str) -> Checkpoint:
        """The checkpoint, which must be recorded, unexpired and on disk; ``shown`` is how errors name it."""
        checkpoint = self.store.get_checkpoint(user, run_id, name)
        if checkpoint is None:
            raise ResourceNotFoundError(f"no checkpoint {shown!r}")
        if not self.directory(user, run_id, name).is_dir():
            raise ConfigurationError(f"checkpoint {shown!r} is recorded but its files are gone")
        return checkpoint

    def hold(self, user: str, run_id: str, name: str, shown: str) -> CheckpointHold:
        """Keep an :meth:`existing` checkpoint's files while a task reads them (its ``path`` is the folder)."""
        with self._lock:
            checkpoint = self.existing(user, run_id, name, shown)
            return self._hold((user, run_id, name), Path(checkpoint.path))

    def hold_for_save(self, user: str, run_id: str, name: str) -> CheckpointHold:
        """Keep checkpoint ``name`` from being reaped or removed while a save writes its folder."""
        key = (user, run_id, name)
        with self._lock:
            self._deleted_while_held.discard(key)  # the new files are not the deleted checkpoint's
            return self._hold(key, self.directory(user, run_id, name))

    def record(self, user: str, run_id: str, name: str, path: str, ttl_seconds: float | None = None) -> Checkpoint:
        """Record a written checkpoint (replacing one of the same name), expiring ``ttl_seconds`` from now."""
        checkpoint = self.store.add_checkpoint(user, run_id, name, path, ttl_seconds)
        if checkpoint is None:
            raise ResourceNotFoundError(f"no run {run_id!r}")
        return checkpoint

    def set_ttl(self, user: str, run_id: str, name: str, ttl_seconds: float | None, shown: str) -> Checkpoint:
        """Expire the checkpoint ``ttl_seconds`` from now, or never (None); the store refuses a bad value."""
        checkpoint = self.store.set_checkpoint_ttl(user, run_id, name, ttl_seconds)
        if checkpoint is None:
            raise ResourceNotFoundError(f"no checkpoint {shown!r}")
        return checkpoint

    def delete(self, user: str, run_id: str, name: str, shown: str) -> None:
        """Forget the checkpoint and remove its folder (once no task holds it); 404 if there is none."""
        key = (user, run_id, name)
        with self._lock:
            if not self.store.delete_checkpoint(user, run_id, name):
                raise ResourceNotFoundError(f"no checkpoint {shown!r}")
            if self._holds[key]:  # the last holder removes it
                self._deleted_while_held.add(key)
                return
            trash = self._discard(key)
        self._removed(key, trash)

    def reap_expired(self) -> int:
        """Delete every expired checkpoint that no task holds (records and folders); returns how many."""
        reaped = 0
        for user, checkpoint in self.store.expired_checkpoints():
            key = (user, checkpoint.run_id, checkpoint.name)
            with self._lock:
                if self._holds[key]:  # a task still reads or writes it: a later sweep deletes it
                    continue
                if not self.store.delete_expired_checkpoint(*key):  # re-saved or given a new TTL meanwhile
                    continue
                trash = self._discard(key)
            self._removed(key, trash)
            reaped += 1
        return reaped

    def start(self) -> None:
        """Sweep now and then every ``sweep_interval_s`` in a background thread, until :meth:`stop`."""
        self._stop.clear()
        self._reaper = threading.Thread(target=self._sweep_forever, name="twinkle-checkpoint-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=30)
            self._reaper = None

    def _sweep_forever(self) -> None:
        while True:
            try:
                reaped = self.reap_expired()
                if reaped:
                    logger.info("deleted %d expired checkpoint(s)", reaped)
            except Exception:
                logger.exception("could not delete expired checkpoints")
            if self._stop.wait(self.sweep_interval_s):
                return

    def _hold(self, key: CheckpointKey, path: Path) -> CheckpointHold:
        self._holds[key] += 1
        return CheckpointHold(self, key, path)

    def _release(self, key: CheckpointKey) -> None:
        with self._lock:
            self._holds[key] -= 1
            if self._holds[key] > 0:
                return
            del self._holds[key]
            if key not in self._deleted_while_held:
                return
            self._deleted_while_held.discard(key)
            trash = self._discard(key)
        self._removed(key, trash)

    def _discard(self, key: CheckpointKey) -> Path | None:
        """Move the folder out of the way (fast, under the lock); :meth:`_removed` deletes it after."""
        directory = self.directory(*key)
        trash = directory.with_name(f".deleted-{secrets.token_hex(8)}")  # no tenant's name starts with '.'
        try:
            directory.rename(trash)
        except FileNotFoundError:
            return None
        return trash

    def _removed(self, key: CheckpointKey, trash: Path | None) -> None:
        """The checkpoint is gone for good: delete its moved-away folder and tell the hooks."""
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        for hook in self.removed_hooks:
            try:
                hook(*key)
            except Exception:
                logger.exception("a checkpoint removal hook failed for %s", key)
