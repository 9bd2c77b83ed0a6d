"""The process-wide runtime: mode, rank, device groups and component placement.

``twinkle.initialize`` creates it once. The local runtime covers one process and
``torchrun`` (detected from its environment variables). Other modes (Ray) are
plugins registered under the entry-point group ``twinkle.runtime``; they
subclass :class:`Runtime` and may return a remote proxy from :meth:`instantiate`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from twinkle.errors import ConfigurationError
from twinkle.infra.device_mesh import DeviceGroup, DeviceMesh

DEFAULT_GROUP = "default"


@dataclass
class Placement:
    """Which component runs on which group (for ``get_device_placement``)."""

    component: str
    group: str
    device_mesh: DeviceMesh | None = None


@dataclass
class Runtime:
    """Local runtime: everything runs in this process (one of ``world_size`` under torchrun)."""

    mode: str = "local"
    seed: int = 42
    full_determinism: bool = False
    lazy_collect: bool = True
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    groups: dict[str, DeviceGroup] = field(default_factory=dict)
    global_device_mesh: DeviceMesh | None = None
    placements: list[Placement] = field(default_factory=list)

    @property
    def is_torchrun(self) -> bool:
        return self.world_size > 1

    def check_group(self, remote_group: str | None) -> str:
        """Return the group name a component is placed on, validating it exists."""
        name = remote_group or DEFAULT_GROUP
        if name not in self.groups:
            raise ConfigurationError(
                f"remote_group {name!r} is not a device group of this run; groups: {sorted(self.groups)}. "
                "Declare it with twinkle.initialize(groups=[DeviceGroup(name=..., ranks=...)])."
            )
        return name

    def instantiate(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], remote_group: str | None) -> Any:
        """Hook for remote runtimes: return a proxy to construct ``cls`` elsewhere, or ``None``.

        The local runtime constructs every component in this process.
        """
        return None

    def place(self, component: Any, remote_group: str | None, device_mesh: DeviceMesh | None) -> str:
        group = self.check_group(remote_group)
        self.placements.append(Placement(type(component).__name__, group, device_mesh))
        return group

    def describe(self) -> str:
        """Human-readable table of groups and the components placed on them."""
        lines = [f"Twinkle runtime: mode={self.mode} rank={self.rank}/{self.world_size} seed={self.seed}"]
        for name, group in self.groups.items():
            lines.append(f"  group {name!r}: ranks={group.ranks} device={group.device_type}")
            for p in self.placements:
                if p.group == name:
                    mesh = f" mesh={p.device_mesh.sizes}" if p.device_mesh else ""
                    lines.append(f"    - {p.component}{mesh}")
        return "\n".join(lines)


# Set for the workers of a component on a one-node Ray cluster (``twinkle.infra.ray.worker``).
INIT_METHOD_ENV = "TWINKLE_DIST_INIT_METHOD"


def process_group_kwargs() -> dict[str, Any]:
    """Arguments for ``torch.distributed.init_process_group`` in this process.

    Empty under torchrun (``env://``, its variables). Data-parallel Ray actors
    on one node meet through a file store instead: torch's TCP store listens on
    every interface whatever address it is given (pytorch/pytorch#173909).
    """
    init_method = os.environ.get(INIT_METHOD_ENV)
    if not init_method:
        return {}
    rank, _, world_size = torchrun_env()
    return {"init_method": init_method, "rank": rank, "world_size": world_size}


def torchrun_env() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from torchrun's variables, ``(0, 0, 1)`` otherwise."""
    try:
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    except ValueError as exc:
        raise ConfigurationError(f"malformed torchrun environment (RANK/LOCAL_RANK/WORLD_SIZE): {exc}") from exc
    return rank, local_rank, world_size
