"""The engine: where runs' calls execute. ``LocalEngine`` is one pool and scheduler in this process.

The HTTP front (routes, store, futures, auth) talks to an engine only, and
describes every call on a run as data (:class:`PoolTask`: a ``ModelPool``
method and its arguments; :class:`FunctionTask`: a module-level function of the
pool, as the Tinker API's work is), because closures cannot reach another process.
``twinkle.server.services.serve.engine.ServeEngine`` runs the same tasks on
Ray Serve replicas, each with its own pool (the base model and a share of the adapters).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from twinkle.server.services.batches import SharedRequest
from twinkle.server.services.pool import ModelPool, RoutingShape
from twinkle.server.services.scheduler import Job, Scheduler

OnDone = Callable[[Any, BaseException | None], None]
Labels = tuple[str, str]


@dataclass(frozen=True)
class PoolTask:
    """``ModelPool.<method>(*args)``: a call that can be sent to another process."""

    method: str
    args: tuple[Any, ...] = ()

    def apply(self, pool: ModelPool) -> Any:
        return getattr(pool, self.method)(*self.args)


@dataclass(frozen=True)
class FunctionTask:
    """``fn(pool, *args)``: ``fn`` must be a module-level function, which pickles by name for the replicas."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()

    def apply(self, pool: ModelPool) -> Any:
        return self.fn(pool, *self.args)


Task = PoolTask | FunctionTask


class Engine(Protocol):
    """What the HTTP front needs from whatever holds the model(s)."""

    max_rank: int
    max_loras: int
    max_length: int
    vocab_size: int
    model_path: str
    model_type: str
    routing: RoutingShape | None  # the model's MoE routing, which ``routed_experts`` must fit; None: not MoE

    @property
    def resident_count(self) -> int: ...

    def template(self, spec: Mapping[str, Any] | None) -> Any: ...

    def is_private(self, run_id: str) -> bool: ...

    def queue_depth(self) -> int: ...

    def busy_seconds(self) -> float:
        """Seconds the model(s) spent running calls so far (replicas' summed; a shared pass counted once)."""

    def submit(
        self,
        key: str,
        task: Task,
        on_done: OnDone,
        shared: SharedRequest | None,
        tokens: int,
        labels: Labels,
        replica: int | None = None,
    ) -> None:
        """Queue ``task`` under ``key`` on ``replica`` (from :meth:`replica_of`), by default ``key``'s replica."""

    def call(self, key: str, task: Task, timeout: float, labels: Labels) -> Any: ...

    def replica_of(self, key: str) -> int:
        """The replica that runs ``key``'s calls now: its run's, else any live one."""

    def place(self, user: str, run_id: str) -> None:
        """Assign a run to a replica before its (asynchronous) loading call is submitted."""

    def unplace(self, run_id: str) -> None:
        """Undo :meth:`place` after the loading call failed."""

    def load_run(self, user: str, run_id: str, task: Task, timeout: float) -> None: ...

    def remove_run(self, user: str, run_id: str, after: Callable[[str], None], timeout: float) -> None: ...

    def replicas(self) -> list[dict[str, Any]]: ...

    def stop(self) -> None: ...


class LocalEngine:
    """Today's server: one :class:`ModelPool` and one :class:`Scheduler` worker thread in this process."""

    def __init__(self, pool: ModelPool, scheduler: Scheduler) -> None:
        self.pool, self.scheduler = pool, scheduler
        self.max_rank, self.max_loras, self.max_length = pool.max_rank, pool.max_loras, pool.max_length
        self.vocab_size, self.model_path = pool.model.vocab_size, pool.model_path
        self.model_type, self.routing = pool.model.model.config.model_type, pool.routing

    @property
    def resident_count(self) -> int:
        return self.pool.resident_count

    def template(self, spec: Mapping[str, Any] | None) -> Any:
        return self.pool.template(spec)

    def is_private(self, run_id: str) -> bool:
        return self.pool.is_private(run_id)

    def queue_depth(self) -> int:
        return self.scheduler.queue_depth()

    def busy_seconds(self) -> float:
        return self.scheduler.busy_seconds()

    def submit(
        self,
        key: str,
        task: Task,
        on_done: OnDone,
        shared: SharedRequest | None,
        tokens: int,
        labels: Labels,
        replica: int | None = None,
    ) -> None:
        self.scheduler.submit(Job(key, lambda: task.apply(self.pool), on_done, shared, tokens, labels))

    def call(self, key: str, task: Task, timeout: float, labels: Labels) -> Any:
        return self.scheduler.call(key, lambda: task.apply(self.pool), timeout, labels)

    def replica_of(self, key: str) -> int:
        return 0

    def place(self, user: str, run_id: str) -> None:
        pass  # one pool holds every run

    def unplace(self, run_id: str) -> None:
        pass

    def load_run(self, user: str, run_id: str, task: Task, timeout: float) -> None:
        self.call(run_id, task, timeout, (user, "create_run"))

    def remove_run(self, user: str, run_id: str, after: Callable[[str], None], timeout: float) -> None:
        def release() -> None:  # ``after`` (release hooks) may use the pool: it runs on the worker thread too
            self.pool.remove_run(run_id)
            after(run_id)

        self.scheduler.call(run_id, release, timeout, (user, "release_run"))

    def replicas(self) -> list[dict[str, Any]]:
        adapters = sorted(self.pool.model.adapter_names)
        return [{"index": 0, "pid": os.getpid(), "alive": True, "runs": adapters, "adapters": adapters}]

    def stop(self) -> None:
        self.scheduler.stop()
        self.pool.close()
