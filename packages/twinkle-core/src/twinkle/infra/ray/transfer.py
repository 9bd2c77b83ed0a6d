"""Move a value (e.g. a trainer's weights) from one component to another without it passing through the driver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twinkle.infra.ray.proxy import ActorProxy


def relay(source: Any, target: Any, read: Callable[[Any], Any], write: Callable[[Any, Any], None]) -> bool:
    """``write(target, read(source))``, each run where its component lives.

    For an actor ``source``, ``read`` runs in its first worker and the result
    stays in the Ray object store; only its ObjectRef passes through the
    driver, and every worker of an actor ``target`` fetches it from the store
    (Ray resolves an ObjectRef passed as a top-level argument). Returns
    ``False``, doing nothing, when neither side is an actor: the caller moves
    the value in-process as before.
    """
    if not isinstance(source, ActorProxy) and not isinstance(target, ActorProxy):
        return False
    import ray

    ref = source._backend.put(read, "relay (read)") if isinstance(source, ActorProxy) else ray.put(read(source))
    if isinstance(target, ActorProxy):
        target._backend.apply(write, ref, "relay (write)")
    else:
        write(target, ray.get(ref))
    return True
