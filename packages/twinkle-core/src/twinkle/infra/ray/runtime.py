"""``twinkle.initialize(mode='ray')``: components constructed with ``remote_group=`` run as Ray actors.

Without ``address=`` (or ``$RAY_ADDRESS``) a local single-node Ray is started
whose every socket listens on 127.0.0.1 only; with one, the driver joins that
cluster. Each device group gets a placement group when its first component is
built (:mod:`twinkle.infra.ray.placement`); a model gets one actor per rank
of its ``device_mesh`` (else of ``global_device_mesh``; else one), any other
component one per share of the data (:func:`twinkle.infra.ray.dispatch.worker_ranks`).
Components built without ``remote_group`` (datasets, a DataLoader) stay in the
driver. ``twinkle.infra.shutdown()`` stops what was started.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import sys
import weakref
from dataclasses import InitVar, dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from twinkle.errors import ConfigurationError, MissingDependencyError
from twinkle.infra.ray.proxy import ActorProxy
from twinkle.infra.runtime import Placement, Runtime
from twinkle.utils.logging import get_logger

if TYPE_CHECKING:  # imported where used: it imports ray
    from twinkle.infra.ray.placement import GroupPlacement

logger = get_logger(__name__)
DRIVER = "driver"
_LOOPBACK = "127.0.0.1"
# Whether this process called ray.init (so shutdown() should end that session), across re-initialisations.
_connected_here = False


class RayNotInstalledError(ConfigurationError, MissingDependencyError):
    """``mode='ray'`` without Ray: a configuration error that names the extra to install."""


@dataclass
class ActorPlacement(Placement):
    """A component's actors on a group; ``proxy`` is a weak reference: dropping the proxy stops the actors."""

    proxy: weakref.ref[ActorProxy] | None = None
    workers: int = 1


@dataclass
class RayRuntime(Runtime):
    """The Ray runtime (see the module docstring); built by ``twinkle.initialize(mode='ray', ...)``.

    ``address``: a Ray cluster to join (default ``$RAY_ADDRESS``, else a local
    Ray is started with ``num_cpus``/``num_gpus``, default: what the machine has).
    ``placement_timeout_s``: how long a device group may wait for its devices.
    ``nproc_per_node`` is accepted for the seed API; Ray reports each node's devices itself.
    """

    mode: str = "ray"
    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    placement_timeout_s: float = 60.0
    nproc_per_node: InitVar[int | None] = None
    _placements: dict[str, GroupPlacement] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self, nproc_per_node: int | None) -> None:
        global _connected_here
        ray = _import_ray()
        import twinkle.infra as infra

        previous = infra._runtime
        if isinstance(previous, RayRuntime):
            previous.release()  # re-initialising replaces the run: its actors and reserved devices go
        if not ray.is_initialized():  # else joined earlier (a previous initialize, or the user's own ray.init)
            address = self.address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, logging_level=logging.WARNING)
            else:
                _start_local_ray(ray, self.num_cpus, self.num_gpus)
            _connected_here = True
        # atexit runs its handlers last-registered first: registered after ray.init's own, this one runs while
        # Ray is still up, and lets the calls a script never waited for finish before Ray stops its actors.
        atexit.unregister(_wait_for_unresolved_calls)
        atexit.register(_wait_for_unresolved_calls)

    def instantiate(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], remote_group: str | None) -> Any:
        """An :class:`ActorProxy` for a component with a ``remote_group``; ``None`` (build here) without."""
        if remote_group is None:
            return None
        from twinkle.infra.ray.actors import RemoteComponent

        group = self.check_group(remote_group)
        device_mesh = kwargs.get("device_mesh") or self.global_device_mesh
        backend = RemoteComponent(cls, args, kwargs, self._placement(group), device_mesh, self)
        proxy = ActorProxy(backend)
        self.placements.append(ActorPlacement(cls.__name__, group, device_mesh, weakref.ref(proxy), backend.size))
        return proxy

    def place(self, component: Any, remote_group: str | None, device_mesh: Any) -> str:
        """Record a component built in the driver (``instantiate`` only declines those without a group)."""
        self.placements.append(Placement(type(component).__name__, DRIVER, device_mesh))
        return DRIVER

    def describe(self) -> str:
        import ray

        resources = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "NPU")}
        lines = [f"Twinkle runtime: mode=ray seed={self.seed} Ray cluster resources={resources}"]
        for name, group in self.groups.items():
            placement = self._placements.get(name)
            reserved = placement.describe() if placement else "no placement group yet (made for its first component)"
            lines.append(f"  group {name!r}: ranks={group.ranks} device={group.device_type}: {reserved}")
            lines += [_component_line(p) for p in self.placements if p.group == name]
        in_driver = [p for p in self.placements if p.group == DRIVER]
        if in_driver:
            lines.append("  driver (this process):")
            lines += [_component_line(p) for p in in_driver]
        return "\n".join(lines)

    def release(self) -> None:
        """Wait for unresolved lazy calls, then remove this run's placement groups (which stops its actors);
        the Ray session stays."""
        _wait_for_unresolved_calls()
        for placement in self._placements.values():
            placement.remove()
        self._placements.clear()

    def shutdown(self) -> None:
        """:meth:`release`, then end the Ray session this process started or joined (a user's own stays)."""
        import ray

        global _connected_here
        self.release()
        if _connected_here:
            ray.shutdown()
            _connected_here = False

    def _placement(self, group: str) -> GroupPlacement:
        if group not in self._placements:
            from twinkle.infra.ray.placement import GroupPlacement

            self._placements[group] = GroupPlacement.create(self.groups[group], self.placement_timeout_s)
        return self._placements[group]


def _wait_for_unresolved_calls() -> None:
    """Let every lazy call finish (logging failures) while Ray still runs; nothing to do before any actor exists."""
    actors = sys.modules.get("twinkle.infra.ray.actors")
    if actors is not None and sys.modules["ray"].is_initialized():
        actors.wait_for_unresolved_calls()


def _import_ray() -> ModuleType:
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise RayNotInstalledError("ray", "twinkle-core[ray]", "twinkle.initialize(mode='ray')") from exc


def _start_local_ray(ray: ModuleType, num_cpus: int | None, num_gpus: int | None) -> None:
    """Start a single-node Ray whose every socket listens on the loopback interface.

    Ray turns a loopback node address into the machine's outward one (so that
    other nodes could join) and its servers listen there, unless cluster
    support is off, as it is on macOS and Windows: turn it off while starting.
    """
    from ray._private import ray_constants as constants

    cluster_support = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(
            address="local",
            _node_ip_address=_LOOPBACK,
            include_dashboard=False,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            logging_level=logging.WARNING,
        )
    finally:
        constants.ENABLE_RAY_CLUSTER = cluster_support
    logger.info("started a local Ray on %s: %s", _LOOPBACK, ray.cluster_resources())


def _component_line(placement: Placement) -> str:
    sizes = placement.device_mesh.sizes.items() if placement.device_mesh else ()
    mesh = " ".join(f"{dim}={size}" for dim, size in sizes if size > 1)
    mesh = f" mesh {mesh}" if mesh else ""
    count = ""
    if isinstance(placement, ActorPlacement):
        released = ", released" if placement.proxy is None or placement.proxy() is None else ""
        count = f": {placement.workers} actor(s){released}"
    return f"    - {placement.component}{count}{mesh}"
