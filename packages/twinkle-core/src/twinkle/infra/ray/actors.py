"""The actors of one remote component: creation, dispatch of calls, collection and error translation.

:class:`RemoteComponent` is the :class:`~twinkle.infra.ray.proxy.Backend` of an
:class:`~twinkle.infra.ray.proxy.ActorProxy`. Every call goes to every worker
(:mod:`twinkle.infra.ray.dispatch` says with which arguments); calls to one
actor run in submission order, so lazy calls keep their sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from twinkle.infra.device_mesh import DeviceMesh
from twinkle.infra.ray.dispatch import BATCH_METHODS, data_leaders, merge, split_arguments, worker_ranks
from twinkle.infra.ray.placement import GroupPlacement
from twinkle.infra.ray.proxy import LazyResult
from twinkle.infra.ray.worker import ComponentWorker, WorkerSetup
from twinkle.infra.runtime import Runtime
from twinkle.utils.logging import get_logger

logger = get_logger(__name__)
_WorkerActor = ray.remote(ComponentWorker)
# Lazy calls of every component that nobody has resolved yet, kept beyond their component's proxy: the driver
# waits for them before its Ray stops, so that a script's last ``model.save(...)`` is not cut off at exit.
_unresolved: list[LazyResult] = []


def wait_for_unresolved_calls() -> list[Exception]:
    """Wait for every lazy call nobody has resolved and log each failure; the failures, in call order."""
    errors = []
    while _unresolved:
        future = _unresolved.pop(0)
        if future.resolved:
            continue
        try:
            future.result()
        except Exception as error:
            logger.error("a lazy call failed, and nobody looked at its result: %s", error)
            errors.append(error)
    return errors


class RemoteComponent:
    """Actors for the ranks of ``device_mesh`` (one without a mesh; ``worker_ranks``) in the group's placement group.

    A component class with ``one_worker_per_rank = True`` (a model: it joins ``torch.distributed`` over its
    mesh, tensor and pipeline parallelism included) gets one per rank, any other one per share of the data.

    With ``lazy_collect=False`` construction waits for every worker to build
    its component, so a constructor's exception surfaces where the component
    is constructed. With ``lazy_collect=True`` it returns at once (components
    load side by side) and the first use waits; a constructor's exception is
    raised by every use.
    """

    def __init__(
        self,
        cls: type,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        placement: GroupPlacement,
        device_mesh: DeviceMesh | None,
        runtime: Runtime,
    ) -> None:
        self.cls = cls
        self.group = placement.group.name
        self.device_mesh = device_mesh
        self.lazy_collect = runtime.lazy_collect
        placement.check_mesh(cls.__name__, device_mesh)
        every_rank = getattr(cls, "one_worker_per_rank", False)  # set by components that join torch.distributed
        self.ranks = worker_ranks(device_mesh, placement.ranks_per_bundle, every_rank)
        self.leaders = data_leaders(device_mesh, self.ranks)  # the workers whose batch results are merged
        # Actor handles as Any: Ray's ActorHandle typing does not model ``handle.method.remote(...)``.
        self.workers: list[Any] = [
            _WorkerActor.options(**placement.actor_options(rank)).remote(
                WorkerSetup(
                    cls.__name__,
                    placement.group,
                    index,
                    len(self.ranks),
                    runtime.seed,
                    runtime.full_determinism,
                    runtime.global_device_mesh,
                )
            )
            for index, rank in enumerate(self.ranks)
        ]
        # Several workers meet for torch.distributed; Ray hands worker 0's answer to each build, not via the driver.
        env = self.workers[0].rendezvous.remote() if len(self.workers) > 1 else {}
        payload = self._shared((args, kwargs), len(self.workers))
        self._building = [w.build.remote(cls, payload, env) for w in self.workers]
        self._build_error: BaseException | None = None
        self._pending: list[tuple[list[Any], LazyResult]] = []
        if not self.lazy_collect:
            self._check_built()

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``method`` on every worker; its collected result, or a :class:`LazyResult` under ``lazy_collect``."""
        self._raise_earlier_failures()
        workers, batch = self.workers, method in BATCH_METHODS
        if batch and len(workers) > 1:
            where = f"{self.cls.__name__}.{method}"
            payloads = split_arguments(args, kwargs, self.device_mesh, self.ranks, where)  # type: ignore[arg-type]
        else:
            payloads = [self._shared((args, kwargs), len(workers))] * len(workers)
        refs = [w.call.remote(method, p) for w, p in zip(workers, payloads, strict=True)]

        def collect() -> Any:
            self._check_built()
            results = self._wait(refs, method)
            return merge([results[i] for i in self.leaders]) if batch and len(results) > 1 else results[0]

        future = LazyResult(collect, f"{self.describe()}.{method}")
        if not self.lazy_collect:
            return future.result()
        self._pending.append((refs, future))
        _unresolved[:] = [f for f in _unresolved if not f.resolved]
        _unresolved.append(future)
        return future

    def read(self, name: str) -> Any:
        """An attribute of the first worker's component (a property, or one set in ``__init__``)."""
        self._check_built()
        return self._wait([self.workers[0].read.remote(name)], name)[0]

    def put(self, fn: Callable[[Any], Any], what: str) -> ray.ObjectRef[Any]:
        """``fn(component)`` run in every worker, the first's kept in the object store there; returns its reference.

        Every worker reads because reading a sharded component (FSDP2, tensor parallelism) is a collective.
        """
        self._check_built()
        refs = [worker.put.remote(fn, index == 0) for index, worker in enumerate(self.workers)]
        ref: ray.ObjectRef[Any] = self._wait(refs, what)[0][0]
        return ref

    def apply(self, fn: Callable[[Any, Any], Any], value: Any, what: str) -> None:
        """``fn(component, value)`` on every worker; each fetches an ObjectRef ``value`` from the object store."""
        self._check_built()
        self._wait([w.apply.remote(fn, value) for w in self.workers], what)

    @property
    def size(self) -> int:
        """How many workers (actors) the component has."""
        return len(self.workers)

    def start(self, fn: Callable[..., Any], arguments: Sequence[tuple[Any, ...]], what: str) -> Callable[[], list[Any]]:
        """``fn(component, *arguments[i])`` started on worker ``i`` (the first ``len(arguments)`` workers) without
        waiting; returns a function that waits for them all and returns their results."""
        self._check_built()
        if len(arguments) > len(self.workers):
            raise ValueError(f"{what}: {len(arguments)} calls for the {len(self.workers)} workers of {self.describe()}")
        refs = [worker.run.remote(fn, args) for worker, args in zip(self.workers, arguments, strict=False)]
        return lambda: self._wait(refs, what)

    def describe(self) -> str:
        return f"{self.cls.__name__} on group {self.group!r} ({len(self.workers)} actor(s))"

    def _wait(self, refs: list[Any], method: str) -> list[Any]:
        results = []
        for index, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except RayTaskError as error:
                where = f"{self.cls.__name__}.{method} (worker {index} on group {self.group!r})"
                raise remote_error(error, where) from error
        return results

    def _check_built(self) -> None:
        """Wait for the workers' constructors (once); after one failed, every use raises its exception."""
        if self._building:
            building, self._building = self._building, []
            try:
                self._wait(building, "__init__")
            except Exception as error:
                self._build_error = error
        if self._build_error is not None:
            raise self._build_error

    def _raise_earlier_failures(self) -> None:
        """Resolve finished lazy calls nobody looked at, so that an exception in one is not lost."""
        for entry in list(self._pending):
            refs, future = entry
            finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(finished) == len(refs):
                self._pending.remove(entry)  # first: its exception is raised once
                future.result()

    @staticmethod
    def _shared(payload: Any, copies: int) -> Any:
        """Arguments sent to several workers go into the object store once; each worker fetches them."""
        return ray.put(payload) if copies > 1 else payload


def remote_error(error: RayTaskError, where: str) -> BaseException:
    """The worker's exception with its original type and a message that starts with ``where``.

    Raise it ``from error``: the chained ``RayTaskError`` carries the worker's traceback.
    """
    cause: BaseException = error.cause
    if isinstance(cause, RayError):  # the original exception could not be pickled
        return RuntimeError(f"{where}: {error}")
    if cause.args and isinstance(cause.args[0], str):
        cause.args = (f"{where}: {cause.args[0]}", *cause.args[1:])
    else:
        cause.args = (where, *cause.args)
    return cause
