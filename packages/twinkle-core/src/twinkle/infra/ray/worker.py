"""The body of every component actor: it builds one component in its worker process and runs the driver's calls.

The actor installs its own runtime first, seeded like the driver, so that a
component built in an actor draws the same random numbers as the same
component built in one process (every data-parallel replica starts identical).
Its rank and world size are the worker's among the component's workers (its
mesh rank), as a torchrun process's would be; its local rank is 0, because Ray
shows an actor only its own devices.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from twinkle.infra.device_mesh import DeviceGroup, DeviceMesh
from twinkle.infra.ray.proxy import END_OF_ITERATION
from twinkle.infra.runtime import DEFAULT_GROUP, INIT_METHOD_ENV, Runtime
from twinkle.utils.seed import seed_everything


def storable(value: Any) -> Any:
    """``value`` as the object store can keep it: a stream (an iterator) as a list."""
    return list(value) if isinstance(value, Iterator) else value


def read_along(component: Any, read: Callable[[Any], Any]) -> None:
    """``read(component)`` with its value dropped (a stream read to its end): a worker taking part in a read
    that is a collective of the workers (a sharded model's weights), whose value another worker keeps."""
    value = read(component)
    for _ in value if isinstance(value, Iterator) else ():
        pass


@dataclass(frozen=True)
class WorkerSetup:
    """Where a worker runs: its group, its index among the component's workers (its mesh rank), and the seed."""

    component: str
    group: DeviceGroup
    rank: int
    world_size: int
    seed: int
    full_determinism: bool
    global_device_mesh: DeviceMesh | None  # components default to it, in actors as in one process


@dataclass
class WorkerRuntime(Runtime):
    """The runtime inside an actor: everything built there stays there.

    Components built without ``remote_group`` (e.g. the dataset a DataLoader's
    factory makes) are placed on the worker's own group.
    """

    home_group: str = DEFAULT_GROUP

    def check_group(self, remote_group: str | None) -> str:
        return super().check_group(remote_group or self.home_group)


class ComponentWorker:
    """One worker of a component (wrapped with ``ray.remote`` by ``twinkle.infra.ray.actors``)."""

    def __init__(self, setup: WorkerSetup) -> None:
        import twinkle.infra as infra

        infra._runtime = WorkerRuntime(
            mode="ray_worker",
            seed=setup.seed,
            full_determinism=setup.full_determinism,
            rank=setup.rank,
            world_size=setup.world_size,
            groups={setup.group.name: setup.group},
            global_device_mesh=setup.global_device_mesh,
            home_group=setup.group.name,
        )
        seed_everything(setup.seed, setup.full_determinism)
        self._setup = setup
        self._component: Any = None
        self._iterator: Any = None

    def rendezvous(self) -> dict[str, str]:
        """How the component's workers meet for torch.distributed: torchrun's variables, at this worker's node on
        a free port; on a one-node cluster also a file store (see :func:`twinkle.infra.process_group_kwargs`)."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((address, 0))
            port = probe.getsockname()[1]
        env = {"MASTER_ADDR": address, "MASTER_PORT": str(port), "WORLD_SIZE": str(self._setup.world_size)}
        if sum(node["Alive"] for node in ray.nodes()) == 1:
            env[INIT_METHOD_ENV] = f"file://{tempfile.gettempdir()}/twinkle-dist-{uuid.uuid4().hex}"
            if address == "127.0.0.1" and "lo" in {name for _, name in socket.if_nameindex()}:
                env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own sockets, which else take the host name's address
        return env

    def build(self, cls: type, payload: tuple[tuple[Any, ...], dict[str, Any]], env: dict[str, str]) -> None:
        """Construct the component (a method rather than ``__init__``, so its exceptions reach the driver as is).

        With several workers, ``env`` (from :meth:`rendezvous`) makes them a
        torchrun-like group, so a model can join its ``torch.distributed``
        process group (DDP, FSDP) exactly as under torchrun.
        """
        if env:
            os.environ.update(env, RANK=str(self._setup.rank), LOCAL_RANK="0")  # an actor sees only its devices
        args, kwargs = payload
        self._component = cls(*args, remote_group=self._setup.group.name, **kwargs)

    def call(self, method: str, payload: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = payload
        if method == "__iter__":  # the iterator stays here; the driver pulls items with __next__
            self._iterator = iter(self._component)
            return None
        if method == "__next__":
            return portable(next(self._iterator, END_OF_ITERATION))
        return portable(getattr(self._component, method)(*args, **kwargs))

    def read(self, name: str) -> Any:
        return portable(getattr(self._component, name))

    def put(self, fn: Callable[[Any], Any], keep: bool) -> list[Any]:
        """``fn(component)`` kept in the object store (``keep``) or dropped; returns ``[ObjectRef]`` or ``[]``.

        Wrapped in a list so that the driver receives the reference, not the value. A stream (an iterator)
        is listed to be kept, and read to its end to be dropped: reading may be a collective of the workers.
        """
        import ray

        if not keep:
            read_along(self._component, fn)
            return []
        return [ray.put(storable(fn(self._component)))]

    def apply(self, fn: Callable[[Any, Any], Any], value: Any) -> None:
        """``fn(component, value)``; a top-level ObjectRef ``value`` arrives here resolved by Ray."""
        fn(self._component, value)

    def run(self, fn: Callable[..., Any], arguments: tuple[Any, ...]) -> Any:
        """``fn(component, *arguments)``, its result sent back."""
        return portable(fn(self._component, *arguments))

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return f"{self._setup.component}[{self._setup.rank}]@{self._setup.group.name}"


_PLAIN = (int, float, str, bool, type(None))


def portable(value: Any) -> Any:
    """``value`` with tensors detached from autograd, which cannot be pickled (and their graph stays here)."""
    if getattr(value, "requires_grad", False) and hasattr(value, "detach"):
        return value.detach()
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: portable(getattr(value, f.name)) for f in fields(value) if f.init})
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, _PLAIN) for v in value):  # token ids, log-probs: the bulk of most results
            return value
        return type(value)(portable(v) for v in value)
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    return value
