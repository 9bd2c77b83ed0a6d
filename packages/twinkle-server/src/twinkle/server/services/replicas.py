"""``twinkle server --ray``: the engine as N Ray actors (replicas), each with the base model and a share of adapters.

The HTTP front keeps one :class:`Scheduler` per replica, whose worker thread
sends that replica one call (or one shared pass) at a time: a run's calls keep
their order, tenants on one replica still share passes, and replicas run side
by side. A run is assigned to the least-loaded live replica when it is loaded
(created or resumed) and stays there until it is released. The assignment is
kept in memory only: after a restart every run is non-resident anyway.

When a replica's process dies, the calls of its runs fail with a
``ServerError`` saying so, ``on_lost`` marks those runs non-resident, and a
resume loads them on a live replica. Ray itself runs locally on 127.0.0.1
(``twinkle.initialize(mode='ray')``) and is stopped with the server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from twinkle.errors import ServerError
from twinkle.model import AdapterRequest, AdapterResult
from twinkle.server.config import ServerConfig
from twinkle.server.services.engine import Labels, OnDone, PoolTask, Task
from twinkle.server.services.pool import ModelPool, Templates
from twinkle.server.services.scheduler import Job, Scheduler
from twinkle.utils import get_logger

logger = get_logger(__name__)
INFO_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


class ReplicaWorker:
    """A replica's process: its own :class:`ModelPool`. Pool calls take a lock; ``info`` answers while one runs."""

    def __init__(self, model_id: str, max_loras: int, max_rank: int) -> None:
        self.pool = ModelPool(model_id, max_loras, max_rank)
        self._lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "pid": os.getpid(), "max_length": pool.max_length, "vocab_size": pool.model.vocab_size,
            "model_path": pool.model_path, "model_type": pool.model.model.config.model_type,
            "adapters": sorted(pool.model.adapter_names),
        }  # fmt: skip

    def apply(self, task: Task) -> Any:
        with self._lock:
            return task.apply(self.pool)

    def forward_backward_many(self, requests: Sequence[AdapterRequest]) -> list[AdapterResult]:
        with self._lock:
            return self.pool.forward_backward_many(requests)


@dataclass
class _Replica:
    index: int
    actor: Any
    pid: int
    scheduler: Scheduler | None = None
    runs: dict[str, str] = field(default_factory=dict)  # run id -> user
    private: set[str] = field(default_factory=set)
    alive: bool = True


class RayEngine:
    """The :class:`~twinkle.server.services.engine.Engine` over ``config.replicas`` Ray actors."""

    def __init__(
        self,
        config: ServerConfig,
        observe: Callable[[str, Job, float], None],
        on_pass: Callable[[int], None],
        on_lost: Callable[[str, str], None],
    ) -> None:
        import ray

        import twinkle.infra

        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        twinkle.infra.initialize(mode="ray")  # a local Ray listening on 127.0.0.1 only
        if threading.current_thread() is threading.main_thread():
            # ray.init's SIGTERM handler exits mid-request, skipping uvicorn's shutdown (and so Ray's): undo it.
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        # num_cpus=0: replicas share the machine's cores; max_concurrency=2 lets ``info`` answer during a call.
        worker = ray.remote(num_cpus=0, max_concurrency=2)(ReplicaWorker)
        actors = [worker.remote(config.model_id, config.max_loras, config.max_rank) for _ in range(config.replicas)]
        infos = ray.get([actor.info.remote() for actor in actors])
        self._ray, self._on_lost, self._lock = ray, on_lost, threading.Lock()
        pairs = enumerate(zip(actors, infos, strict=True))
        self._replicas = [_Replica(index, actor, info["pid"]) for index, (actor, info) in pairs]
        for replica in self._replicas:
            replica.scheduler = Scheduler(
                lambda requests, r=replica: self._forward_backward_many(r, requests),
                max_tokens_per_pass=config.max_tokens_per_pass, observe=observe, on_pass=on_pass,
            )  # fmt: skip
        self.max_rank, self.max_loras = config.max_rank, config.max_loras * config.replicas
        self.max_length, self.vocab_size = infos[0]["max_length"], infos[0]["vocab_size"]
        self.model_path, self.model_type = infos[0]["model_path"], infos[0]["model_type"]
        self._templates = Templates(self.model_path)
        logger.info("%d replicas started (pids %s)", len(actors), [r.pid for r in self._replicas])

    @property
    def resident_count(self) -> int:
        return sum(len(r.runs) for r in self._replicas if r.alive)

    def template(self, spec: Mapping[str, Any] | None) -> Any:
        return self._templates.get(spec)

    def is_private(self, run_id: str) -> bool:
        return any(run_id in r.private for r in self._replicas)

    def queue_depth(self) -> int:
        return sum(r.scheduler.queue_depth() for r in self._replicas if r.scheduler is not None)

    def submit(
        self,
        key: str,
        task: Task,
        on_done: OnDone,
        shared: AdapterRequest | None,
        tokens: int,
        labels: Labels,
        replica: int | None = None,
    ) -> None:
        target = self._route(key) if replica is None else self._replicas[replica]
        target.scheduler.submit(Job(key, lambda: self._apply(target, key, task), on_done, shared, tokens, labels))

    def call(self, key: str, task: Task, timeout: float, labels: Labels) -> Any:
        replica = self._route(key)
        return replica.scheduler.call(key, lambda: self._apply(replica, key, task), timeout, labels)

    def replica_of(self, key: str) -> int:
        return self._route(key).index

    def place(self, user: str, run_id: str) -> None:
        """The run's replica: the one it is on, else the live one with the fewest runs."""
        with self._lock:
            replica = self._placed(run_id)
            if replica is None:
                live = [r for r in self._replicas if r.alive]
                if not live:
                    raise ServerError("every replica has died; restart the server")
                replica = min(live, key=lambda r: len(r.runs))
            replica.runs[run_id] = user

    def unplace(self, run_id: str) -> None:
        with self._lock:
            for replica in self._replicas:
                replica.runs.pop(run_id, None)
                replica.private.discard(run_id)

    def load_run(self, user: str, run_id: str, task: Task, timeout: float) -> None:
        """Load the run on its replica (see :meth:`place`)."""
        self.place(user, run_id)
        replica = self._route(run_id)
        try:
            self.call(run_id, task, timeout, (user, "create_run"))
            if self.call(run_id, PoolTask("is_private", (run_id,)), timeout, (user, "create_run")):
                replica.private.add(run_id)  # known here: whether its calls may join shared passes
        except Exception:
            self.unplace(run_id)
            raise

    def remove_run(self, user: str, run_id: str, after: Callable[[str], None], timeout: float) -> None:
        if self._placed(run_id) is None:
            after(run_id)
            return
        self.call(run_id, PoolTask("remove_run", (run_id,)), timeout, (user, "release_run"))
        try:
            after(run_id)  # before the run is unplaced: hooks may queue clean-up on its replica
        finally:
            self.unplace(run_id)

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica's pid, the runs assigned to it, and the adapters it holds (asked of the replica)."""
        listing = []
        for r in self._replicas:
            adapters = None
            if r.alive:
                try:
                    adapters = self._ray.get(r.actor.info.remote(), timeout=INFO_TIMEOUT_S)["adapters"]
                except Exception:  # a dying or busy replica: listed without its adapters
                    logger.warning("replica %d did not describe itself", r.index)
            listing.append({"index": r.index, "pid": r.pid, "alive": r.alive, "runs": sorted(r.runs),
                            "adapters": adapters})  # fmt: skip
        return listing

    def stop(self) -> None:
        import twinkle.infra

        for replica in self._replicas:
            if replica.scheduler is not None:
                replica.scheduler.stop()
            self._ray.kill(replica.actor)
        started = psutil.Process().children(recursive=True)  # Ray's processes: GCS, raylet and their agents
        twinkle.infra.shutdown()  # ends the local Ray this process started
        # The raylet's agents can outlive it (seen with Ray 2.60): end whatever this server started and is left.
        _, alive = psutil.wait_procs(started, timeout=STOP_TIMEOUT_S)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def _placed(self, run_id: str) -> _Replica | None:
        return next((r for r in self._replicas if run_id in r.runs), None)

    def _route(self, key: str) -> _Replica:
        """The run's replica; calls not on a run (sampling the base model) go to the least-loaded live one."""
        with self._lock:
            replica = self._placed(key) or min((r for r in self._replicas if r.alive), key=lambda r: len(r.runs),
                                               default=None)  # fmt: skip
        if replica is None:
            raise ServerError("every replica has died; restart the server")
        return replica

    def _apply(self, replica: _Replica, key: str, task: Task) -> Any:
        return self._get(replica, replica.actor.apply.remote(task), [key])

    def _forward_backward_many(self, replica: _Replica, requests: list[AdapterRequest]) -> list[AdapterResult]:
        ref = replica.actor.forward_backward_many.remote(requests)
        return self._get(replica, ref, [request.adapter_name for request in requests])

    def _get(self, replica: _Replica, ref: Any, keys: list[str]) -> Any:
        """The call's result; the replica's exception as raised there; a clear error if the replica died."""
        from ray.exceptions import RayActorError, RayError, RayTaskError

        try:
            return self._ray.get(ref)
        except RayTaskError as error:
            raise (error.cause if not isinstance(error.cause, RayError) else RuntimeError(str(error))) from None
        except RayActorError as error:
            self._lost(replica)
            runs = ", ".join(repr(k) for k in keys)
            raise ServerError(
                f"the replica holding run {runs} died; resume the run from your last checkpoint"
            ) from error

    def _lost(self, replica: _Replica) -> None:
        """Its runs become non-resident (once): they can be resumed on a live replica."""
        with self._lock:
            if not replica.alive:
                return
            replica.alive = False
            runs, replica.runs = dict(replica.runs), {}
            replica.private.clear()
        logger.error("replica %d (pid %d) died; its runs %s are no longer loaded", replica.index, replica.pid,
                     sorted(runs))  # fmt: skip
        for run_id, user in runs.items():
            self._on_lost(user, run_id)
