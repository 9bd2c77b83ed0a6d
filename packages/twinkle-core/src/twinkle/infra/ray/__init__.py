"""Ray runtime plugin (entry point ``twinkle.runtime: ray``): ``twinkle.initialize(mode='ray', groups=[...])``.

- :mod:`.runtime`: :class:`RayRuntime`: the local or joined Ray cluster, components as actors, ``describe``.
- :mod:`.placement`: one placement group per device group.
- :mod:`.actors`, :mod:`.worker`: a component's actors, on the driver's and on the worker's side.
- :mod:`.dispatch`: how a batch method's arguments are split over the workers and its results merged.
- :mod:`.proxy`: the driver-side :class:`ActorProxy` and the :class:`LazyResult` of a lazy call.
- :mod:`.transfer`: :func:`relay`: component to component through the object store (weight sync).

Importing this package does not import Ray; starting the runtime or building an actor does.
"""

from twinkle.infra.ray.dispatch import BATCH_METHODS
from twinkle.infra.ray.proxy import ActorProxy, LazyResult
from twinkle.infra.ray.runtime import RayRuntime
from twinkle.infra.ray.transfer import relay

__all__ = ["BATCH_METHODS", "ActorProxy", "LazyResult", "RayRuntime", "relay"]
