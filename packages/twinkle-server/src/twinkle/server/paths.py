"""Turning tenant-supplied names (checkpoint names, run ids) into paths that stay inside a root.

Each part must be one plain name: no separators, no ``.``/``..``, no NUL, no
leading dot (which would also collide with ``atomic_directory``'s temporary
siblings). The joined path is then resolved, so a symlink inside the root that
points elsewhere is refused too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from twinkle.errors import InvalidInputError

# Sampler-only checkpoints (Tinker's ``sampler_weights/<name>``) live in this folder of a run's checkpoints.
SAMPLER_WEIGHTS_DIR = "sampler_weights"
_MAX_NAME_BYTES = 255  # the usual file-name limit (ext4, APFS, NTFS)


def safe_child(root: str | Path, *user_parts: str) -> Path:
    """``root / part / ...`` resolved, after checking that no part can escape ``root``."""
    if not user_parts:
        raise InvalidInputError("safe_child needs at least one name below the root")
    for part in user_parts:
        check_name(part)
    base = Path(root).expanduser().resolve()
    path = base.joinpath(*user_parts).resolve()
    if not path.is_relative_to(base) or path == base:
        raise InvalidInputError(f"path {'/'.join(user_parts)!r} resolves outside its root (through a symlink)")
    return path


@contextmanager
def atomic_child(root: str | Path, *user_parts: str) -> Iterator[Path]:
    """Write a directory at ``safe_child(root, *user_parts)`` atomically: yields a temporary folder to fill.

    Delegates to ``twinkle.model.atomic_directory`` (imported here,
    as it pulls in torch) so checkpoints saved by the server and in-process share
    one crash-safety rule: the final folder appears complete or not at all.
    """
    from twinkle.model import atomic_directory

    with atomic_directory(safe_child(root, *user_parts)) as tmp:
        yield tmp


def check_name(part: str) -> str:
    """``part`` if it is one plain file name (see the module doc)."""
    if not isinstance(part, str):
        raise InvalidInputError(f"a path name must be a string, got {type(part).__name__}")
    problem = None
    if not part:
        problem = "is empty"
    elif "\x00" in part:
        problem = "contains a NUL character"
    elif "/" in part or "\\" in part:
        problem = "contains a path separator"
    elif part.startswith("."):
        problem = "starts with '.'"
    elif len(part.encode("utf-8")) > _MAX_NAME_BYTES:
        problem = f"is longer than {_MAX_NAME_BYTES} bytes"
    if problem:
        raise InvalidInputError(f"invalid name {part!r}: it {problem}; use a single plain file name")
    return part
