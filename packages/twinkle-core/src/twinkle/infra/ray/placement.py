"""One Ray placement group per device group, and where each worker of a component goes in it.

A CPU group reserves one ``{'CPU': 1}`` bundle per rank; an accelerator group
one bundle of ``gpus_per_worker`` devices per worker. A component's worker for
mesh rank ``r`` runs in bundle ``r // ranks_per_bundle`` and asks for only a
small share of it, so that several components can share a group's devices
(a model and its DataLoader, as in one process) while the placement group
keeps other work off them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from twinkle.errors import ConfigurationError
from twinkle.infra.device_mesh import DeviceGroup, DeviceMesh

_RESOURCE = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}
WORKER_SHARE = 0.01  # of a bundle, per component worker: up to 100 components can share a group's devices


def bundles_for(group: DeviceGroup) -> list[dict[str, float]]:
    """The placement group's bundles for ``group`` (see the module docstring)."""
    resource = _resource(group)
    if resource == "CPU":
        return [{"CPU": 1.0} for _ in range(group.world_size)]
    if group.world_size % group.gpus_per_worker:
        raise ConfigurationError(
            f"device group {group.name!r}: {group.world_size} ranks are not a multiple of "
            f"gpus_per_worker={group.gpus_per_worker}"
        )
    return [{resource: float(group.gpus_per_worker)} for _ in range(group.world_size // group.gpus_per_worker)]


@dataclass
class GroupPlacement:
    """A device group and the Ray placement group that reserves its devices."""

    group: DeviceGroup
    bundles: list[dict[str, float]]
    placement_group: PlacementGroup

    @classmethod
    def create(cls, group: DeviceGroup, timeout_s: float) -> GroupPlacement:
        """Reserve the group's bundles; a clear error when the cluster cannot hold them within ``timeout_s``."""
        bundles = bundles_for(group)
        pg = placement_group(bundles, strategy="PACK", name=f"twinkle-{group.name}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            needed = {k: sum(b.get(k, 0.0) for b in bundles) for k in bundles[0]}
            raise ConfigurationError(
                f"device group {group.name!r} needs {needed} in {len(bundles)} bundle(s), but the Ray cluster "
                f"could not reserve them in {timeout_s:.0f} s (available: {ray.available_resources()}). "
                "Use fewer ranks, or a cluster with more devices (a local Ray takes num_cpus=/num_gpus= "
                "from twinkle.initialize)."
            )
        return cls(group, bundles, pg)

    @property
    def ranks_per_bundle(self) -> int:
        return 1 if _resource(self.group) == "CPU" else self.group.gpus_per_worker

    def check_mesh(self, component: str, device_mesh: DeviceMesh | None) -> None:
        if device_mesh is not None and device_mesh.world_size > self.group.world_size:
            raise ConfigurationError(
                f"{component}: its device_mesh spans {device_mesh.world_size} ranks, but device group "
                f"{self.group.name!r} has {self.group.world_size}"
            )

    def actor_options(self, mesh_rank: int) -> dict[str, Any]:
        """``ray.remote(...).options(...)`` for the worker of ``mesh_rank``."""
        resource = _resource(self.group)
        share: dict[str, Any] = {"num_cpus": WORKER_SHARE}
        if resource == "GPU":
            share = {"num_cpus": 0, "num_gpus": WORKER_SHARE}
        elif resource != "CPU":
            share = {"num_cpus": 0, "resources": {resource: WORKER_SHARE}}
        strategy = PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=mesh_rank // self.ranks_per_bundle
        )
        return {**share, "scheduling_strategy": strategy}

    def remove(self) -> None:
        """Release the devices; Ray also stops the actors placed in them."""
        remove_placement_group(self.placement_group)

    def describe(self) -> str:
        return f"Ray placement group {self.placement_group.id.hex()[:8]}, {len(self.bundles)} bundle(s) {self.bundles}"


def _resource(group: DeviceGroup) -> str:
    if group.device_type not in _RESOURCE:
        raise ConfigurationError(
            f"device group {group.name!r}: device_type {group.device_type!r} has no Ray resource; "
            f"use one of {sorted(_RESOURCE)}"
        )
    return _RESOURCE[group.device_type]
