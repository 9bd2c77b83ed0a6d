"""Applying and removing patches: ``apply_patch``, ``remove_patch``, and ``patched`` for a scope.

A target remembers its patches in the order they were applied (in one
attribute, deleted with the last patch), so each is removed by exactly its own
undo and a target with every patch removed is as it was never patched. Patches
come off in reverse order: one applied later may build on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from twinkle.errors import ConfigurationError
from twinkle.interfaces import Patch
from twinkle.registry import build

__all__ = ["PatchSpec", "applied_patches", "apply_patch", "patched", "remove_patch"]

PatchSpec = Patch | type | str  # an instance, a class, or a registered / entry-point name
_APPLIED = "_twinkle_patches"


def _applied(target: Any) -> list[tuple[Patch, Any]]:
    applied: list[tuple[Patch, Any]] = getattr(target, _APPLIED, [])
    return applied


def applied_patches(target: Any) -> list[str]:
    """Names of the patches applied to ``target``, oldest first."""
    return [patch.name for patch, _ in _applied(target)]


def apply_patch(target: Any, patch: PatchSpec) -> Patch:
    """Apply ``patch`` to ``target`` and return it; a patch that does not fit is refused, nothing changed."""
    instance: Patch = build("patch", patch)
    if not isinstance(instance, Patch):
        raise ConfigurationError(f"{instance!r} is not a twinkle.interfaces.Patch")
    if instance.name in applied_patches(target):
        raise ConfigurationError(f"{instance.name} is already applied to {type(target).__name__}")
    instance.check(target)
    undo = instance.apply(target)
    applied = _applied(target)
    if not applied:
        setattr(target, _APPLIED, applied)
    applied.append((instance, undo))
    return instance


def remove_patch(target: Any, patch: PatchSpec | None = None) -> None:
    """Undo ``patch`` (its instance or name; ``None``: every patch, newest first) on ``target``."""
    applied = _applied(target)
    if patch is None:
        while applied:
            remove_patch(target, applied[-1][0])
        return
    name = patch if isinstance(patch, str) else (patch if isinstance(patch, Patch) else build("patch", patch)).name
    names = applied_patches(target)
    if name not in names:
        raise ConfigurationError(f"{name} is not applied to {type(target).__name__} (applied: {names})")
    if names[-1] != name:
        raise ConfigurationError(f"{names[-1]} was applied to {type(target).__name__} after {name}; remove it first")
    _, undo = applied.pop()
    undo()
    if not applied:
        delattr(target, _APPLIED)


@contextmanager
def patched(target: Any, *patches: PatchSpec) -> Iterator[Any]:
    """``target`` with ``patches`` applied inside the block, and removed (newest first) on leaving it."""
    done: list[Patch] = []
    try:
        for patch in patches:
            done.append(apply_patch(target, patch))
        yield target
    finally:
        for patch in reversed(done):
            remove_patch(target, patch)
