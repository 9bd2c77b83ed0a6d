"""Move a value (e.g. a trainer's weights) from one component to another without it passing through the driver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twinkle.infra.device_mesh import DeviceGroup
from twinkle.infra.ray.proxy import ActorProxy
from twinkle.infra.ray.worker import read_along, storable


def relay(source: Any, target: Any, read: Callable[[Any], Any], write: Callable[[Any, Any], None]) -> bool:
    """``write(target, read(source))``, each run where its component lives.

    For an actor ``source``, ``read`` runs in every worker (reading a sharded
    component is a collective) and the first worker's result stays in the Ray
    object store; only its ObjectRef passes through the driver, and every
    worker of an actor ``target`` fetches it from the store (Ray resolves an
    ObjectRef passed as a top-level argument). A stream (an iterator) that
    ``read`` returns is stored as a list. Returns ``False``, doing nothing,
    when neither side is an actor: the caller moves the value in-process.
    """
    if not isinstance(source, ActorProxy) and not isinstance(target, ActorProxy):
        return False
    import ray

    if isinstance(source, ActorProxy):
        ref = source._backend.put(read, "relay (read)")
    else:
        ref = ray.put(storable(read(source)))
    if isinstance(target, ActorProxy):
        target._backend.apply(write, ref, "relay (write)")
    else:
        write(target, ray.get(ref))
    return True


def exchange(
    source: Any,
    target: Any,
    prepare: Callable[[Any, str, int], Any],
    send: Callable[[Any, Any], Any],
    receive: Callable[[Any, Any, int], Any],
    read: Callable[[Any], Any],
) -> bool:
    """A transfer the components make between themselves (e.g. a broadcast), all of their sides at once.

    ``plan = prepare(source, host, receivers)`` runs first in the source's first worker (``host``: its
    node's address; ``receivers``: how many workers the target has); then ``send(source, plan)`` there,
    ``read(source)`` in the source's other workers, its value dropped (they take part in reading a sharded
    source, a collective), and ``receive(target, plan, rank)`` in every worker of the target (``rank``
    1 .. receivers) run at the same time. Waits for every side and raises the source's first exception,
    else the first receiver's. Returns ``False``, doing nothing, unless both components are actors.
    """
    if not isinstance(source, ActorProxy) or not isinstance(target, ActorProxy):
        return False
    senders, receivers = source._backend, target._backend
    plan = senders.start(_prepare, [(prepare, receivers.size)], "exchange (prepare)")()[0]
    receiving = receivers.start(receive, [(plan, rank) for rank in range(1, receivers.size + 1)], "exchange (receive)")
    sides = [(send, (plan,))] + [(read_along, (read,))] * (senders.size - 1)
    sending = senders.start(_side, sides, "exchange (send)")
    errors = []
    for wait in (sending, receiving):
        try:
            wait()
        except Exception as error:  # the other side still finishes (a sender's failure stops its receivers)
            errors.append(error)
    if errors:
        raise errors[0]
    return True


def _side(component: Any, fn: Callable[..., Any], arguments: tuple[Any, ...]) -> Any:
    return fn(component, *arguments)


def _prepare(component: Any, prepare: Callable[[Any, str, int], Any], receivers: int) -> Any:
    import ray

    return prepare(component, ray.util.get_node_ip_address(), receivers)


def device_group_of(component: Any) -> DeviceGroup | None:
    """The device group an actor component's workers are placed on; ``None`` for a component in this process."""
    if not isinstance(component, ActorProxy):
        return None
    from twinkle.infra import get_runtime  # here: twinkle.infra imports this module

    return get_runtime().groups.get(component._backend.group)
