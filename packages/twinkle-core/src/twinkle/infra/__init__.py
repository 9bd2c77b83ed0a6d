"""Infrastructure: ``initialize``, device groups and meshes, and component placement.

Components are plain classes decorated with :func:`remote_class`; the runtime
chosen by :func:`initialize` decides whether constructing one builds it in this
process or (for remote runtimes) returns a proxy with the same methods.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Literal, cast

from twinkle.errors import ConfigurationError
from twinkle.infra.device_mesh import DeviceGroup, DeviceMesh
from twinkle.infra.ray.transfer import device_group_of, exchange, relay
from twinkle.infra.remote import remote_class
from twinkle.infra.runtime import DEFAULT_GROUP, Runtime, process_group_kwargs, torchrun_env
from twinkle.utils.logging import get_logger
from twinkle.utils.seed import seed_everything

logger = get_logger(__name__)
RUNTIME_ENTRY_POINT_GROUP = "twinkle.runtime"

_runtime: Runtime | None = None


def initialize(
    mode: Literal["local", "ray"] | str | None = None,
    *,
    seed: int = 42,
    full_determinism: bool = False,
    nproc_per_node: int | None = None,
    groups: list[DeviceGroup] | None = None,
    global_device_mesh: DeviceMesh | None = None,
    lazy_collect: bool = True,
    **runtime_kwargs: object,
) -> Runtime:
    """Set up the run: seeds, device groups, and the execution mode.

    ``mode`` defaults to ``$TWINKLE_MODE`` or ``'local'`` (one process, or one of
    the processes started by ``torchrun``). Calling it again replaces the runtime.
    """
    global _runtime
    mode = mode or os.environ.get("TWINKLE_MODE", "local")
    if nproc_per_node is not None and (not isinstance(nproc_per_node, int) or nproc_per_node < 1):
        raise ConfigurationError(f"nproc_per_node must be an int >= 1, got {nproc_per_node!r}")
    seed_everything(seed, full_determinism)
    if mode == "local":
        if runtime_kwargs:
            raise ConfigurationError(f"unexpected argument(s) for mode='local': {sorted(runtime_kwargs)}")
        rank, local_rank, world_size = torchrun_env()
        runtime = Runtime(
            mode="local",
            seed=seed,
            full_determinism=full_determinism,
            lazy_collect=lazy_collect,
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            global_device_mesh=global_device_mesh,
        )
    else:
        runtime = _load_runtime_plugin(mode)(
            seed=seed,
            full_determinism=full_determinism,
            nproc_per_node=nproc_per_node,
            lazy_collect=lazy_collect,
            global_device_mesh=global_device_mesh,
            **runtime_kwargs,
        )
    runtime.groups = _index_groups(groups, runtime.world_size)
    _runtime = runtime
    logger.debug("initialized %s", runtime.describe())
    return runtime


def _load_runtime_plugin(mode: str) -> Callable[..., Runtime]:
    """A plugin's :class:`Runtime` subclass; its constructor takes that runtime's own keywords."""
    available = {ep.name: ep for ep in entry_points(group=RUNTIME_ENTRY_POINT_GROUP)}
    if mode not in available:
        raise ConfigurationError(
            f"mode={mode!r} is not available: no runtime named {mode!r} is installed "
            f"(entry-point group {RUNTIME_ENTRY_POINT_GROUP!r}). Installed modes: {['local', *sorted(available)]}"
        )
    return cast("Callable[..., Runtime]", available[mode].load())


def _index_groups(groups: list[DeviceGroup] | None, world_size: int) -> dict[str, DeviceGroup]:
    if not groups:
        return {DEFAULT_GROUP: DeviceGroup(DEFAULT_GROUP, ranks=world_size)}
    indexed: dict[str, DeviceGroup] = {}
    for group in groups:
        if not isinstance(group, DeviceGroup):
            raise ConfigurationError(f"groups must contain DeviceGroup objects, got {type(group).__name__}")
        if group.name in indexed:
            raise ConfigurationError(f"duplicate device group name {group.name!r}")
        indexed[group.name] = group
    return indexed


def get_runtime() -> Runtime:
    """The current runtime. Without ``initialize`` a default local one is created on first use.

    That default touches no RNG: only an explicit ``initialize(seed=...)`` seeds,
    so constructing a component never changes the random numbers a user drew.
    """
    global _runtime
    if _runtime is None:
        rank, local_rank, world_size = torchrun_env()
        _runtime = Runtime(rank=rank, local_rank=local_rank, world_size=world_size)
        _runtime.groups = _index_groups(None, world_size)
    return _runtime


def get_device_placement() -> str:
    """Where every device group is and which components were placed on it."""
    return get_runtime().describe()


def shutdown() -> None:
    """Release what the current runtime holds and forget it (the next use builds a default local one).

    For ``mode='ray'``: its actors and placement groups, and the Ray session it
    started (a local Ray stops) or joined. The local runtime holds nothing.
    """
    global _runtime
    release = getattr(_runtime, "shutdown", None)
    if release is not None:
        release()
    _runtime = None


def is_master() -> bool:
    """True on global rank 0 (the process that should log and write shared files)."""
    return get_runtime().rank == 0


__all__ = [
    "DEFAULT_GROUP",
    "DeviceGroup",
    "DeviceMesh",
    "Runtime",
    "device_group_of",
    "exchange",
    "get_device_placement",
    "get_runtime",
    "initialize",
    "is_master",
    "process_group_kwargs",
    "relay",
    "remote_class",
    "shutdown",
]
