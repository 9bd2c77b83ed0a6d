"""The on-disk cache where built-in models and datasets are built on first use.

A built-in is generated into a staging directory beside its final place and then
renamed into place with ``os.replace``. The rename is atomic, so the final
directory either does not exist or is complete: a crash or Ctrl-C mid-build can
never leave a half-written model that later runs would trust. A file lock makes
concurrent processes (several test workers, ranks of one job) build it only once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from twinkle.utils import get_logger

logger = get_logger(__name__)

CACHE_ENV = "TWINKLE_CACHE_DIR"


def cache_root() -> Path:
    """Return ``$TWINKLE_CACHE_DIR`` or ``~/.cache/twinkle``.

    Read on every call (not at import) so that a process can point the cache
    elsewhere, e.g. a test session using a temporary directory.
    """
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "twinkle"


def materialize(name: str, build: Callable[[Path], None]) -> Path:
    """Return ``<cache>/builtin/<name>``, calling ``build(staging_dir)`` first if it is missing.

    ``name`` should carry a format version (``qwen3-tiny-v1``) so that a change in
    what ``build`` writes gets a fresh directory instead of reusing a stale one.
    """
    root = cache_root() / "builtin"
    final = root / name
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{name}.lock")):
        if final.is_dir():  # another process finished it while we waited for the lock
            return final
        _remove_abandoned_staging(root, name)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache entry should read like any directory
        logger.info("Building builtin '%s' into %s (first use only)", name, final)
        try:
            build(staging)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final


def _remove_abandoned_staging(root: Path, name: str) -> None:
    """Delete staging directories left by builders that were killed.

    Safe only while holding the lock: no live builder of ``name`` can own one.
    """
    for leftover in root.glob(f".{name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
