"""``twinkle server --ray``: the engine over a Ray Serve application of N model replicas.

Each replica (``replica.ModelReplica``) holds the base model and a share of the
adapters. The HTTP front keeps one :class:`Scheduler` per replica, whose worker
thread sends that replica one call (or one shared pass) at a time: a run's
calls keep their order, tenants on one replica still share passes, and
replicas run side by side. A run is placed on the least-loaded live replica
when it is loaded (created or resumed) and every call of the run is addressed
to that replica (``router.PinnedReplicaRouter``). Placement is kept in memory
only: after a restart every run is non-resident anyway.

When a replica dies, the calls of its runs fail with a ``ServerError`` saying
so, ``on_lost`` marks those runs non-resident, and a resume loads them on a
live replica. Serve starts a replacement replica, which joins with no runs.
Ray runs locally on 127.0.0.1 (``twinkle.initialize(mode='ray')``), Serve
without its HTTP proxy (the front is this process's server), and both stop
with the server.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psutil

from twinkle.errors import ServerError
from twinkle.model import AdapterResult
from twinkle.sampler import SampleResult
from twinkle.server.config import ServerConfig
from twinkle.server.services.batches import SAMPLE, SharedRequest, batch_kind
from twinkle.server.services.engine import Labels, OnDone, PoolTask, Task
from twinkle.server.services.pool import Templates
from twinkle.server.services.scheduler import Job, Scheduler
from twinkle.server.services.serve import live
from twinkle.server.services.serve.replica import ModelReplica
from twinkle.utils import get_logger

logger = get_logger(__name__)
APP = "twinkle"
ROUTER = "twinkle.server.services.serve.router:PinnedReplicaRouter"
START_TIMEOUT_S = 300.0
INFO_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


@dataclass
class _Replica:
    index: int  # in order of arrival: replacements get new numbers
    replica_id: str  # Serve's
    pid: int
    scheduler: Scheduler
    runs: dict[str, str] = field(default_factory=dict)  # run id -> user
    private: set[str] = field(default_factory=set)
    alive: bool = True


class ServeEngine:
    """The :class:`~twinkle.server.services.engine.Engine` over ``config.replicas`` Serve replicas."""

    def __init__(
        self,
        config: ServerConfig,
        observe: Callable[[str, Job, float], None],
        on_pass: Callable[[list[Job]], None],
        on_lost: Callable[[str, str], None],
    ) -> None:
        import twinkle.infra

        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        twinkle.infra.initialize(mode="ray")  # a local Ray listening on 127.0.0.1 only
        if threading.current_thread() is threading.main_thread():
            # ray.init's SIGTERM handler exits mid-request, skipping uvicorn's shutdown (and so Ray's): undo it.
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        self._on_lost, self._lock = on_lost, threading.Condition()
        self._replicas: list[_Replica] = []
        self._known: set[str] = set()
        self._scheduler_options: dict[str, Any] = {
            "max_tokens_per_pass": config.max_tokens_per_pass,
            "batch_budgets": {SAMPLE: config.max_tokens_per_sample_batch},
            "cycle_wait_s": config.cycle_wait_s,
            "observe": observe,
            "on_pass": on_pass,
            "batch_kind": batch_kind,
        }
        try:
            info = self._start_serve(config)
        except BaseException:
            self.stop()  # Ray's processes must not outlive a server that failed to start
            raise
        self.max_rank, self.max_loras = config.max_rank, config.max_loras * config.replicas
        self.max_length, self.vocab_size = info["max_length"], info["vocab_size"]
        self.model_path, self.model_type, self.routing = info["model_path"], info["model_type"], info["routing"]
        self._templates = Templates(self.model_path)
        logger.info("%d replicas started (pids %s)", config.replicas, [r.pid for r in self._replicas])

    def _start_serve(self, config: ServerConfig) -> dict[str, Any]:
        """Deploy the replicas; the first one's ``info`` once ``config.replicas`` of them are admitted."""
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        quiet = {"log_level": "WARNING", "enable_access_log": False}  # else Serve logs every call
        serve.start(proxy_location="Disabled", logging_config=quiet)  # no Serve HTTP: this process is the front
        # Ray annotates serve.deployment as a decorator factory only; given a class it returns the Deployment.
        deployment = serve.deployment(ModelReplica).options(  # type: ignore[attr-defined]
            name="model",
            num_replicas=config.replicas,
            ray_actor_options={"num_cpus": 0},  # replicas share the machine's cores
            max_ongoing_requests=4,  # one pool call at a time (the front's scheduler) plus ``info``
            graceful_shutdown_timeout_s=STOP_TIMEOUT_S,
            # Ray types every keyword of RequestRouterConfig.__init__ as a dict; it takes the router's import path.
            request_router_config=RequestRouterConfig(
                request_router_class=ROUTER,  # type: ignore[arg-type]
                request_router_kwargs={"app": APP},
            ),
            logging_config=quiet,
        )
        self._handle = serve.run(
            deployment.bind(config.model_id, config.max_loras, config.max_rank, config.device, config.model_options),
            name=APP,
            route_prefix=None,
        )
        live.subscribe(APP, self._on_replicas)  # before the first call, which starts this process's router
        with ThreadPoolExecutor(1) as thread:  # Serve refuses blocking calls on an event loop (the app's lifespan)
            return thread.submit(self._wait_for_replicas, config.replicas).result()

    @property
    def resident_count(self) -> int:
        return sum(len(r.runs) for r in self._replicas if r.alive)

    def template(self, spec: Mapping[str, Any] | None) -> Any:
        return self._templates.get(spec)

    def is_private(self, run_id: str) -> bool:
        return any(run_id in r.private for r in self._replicas)

    def queue_depth(self) -> int:
        return sum(r.scheduler.queue_depth() for r in self._replicas)

    def busy_seconds(self) -> float:
        return sum(r.scheduler.busy_seconds() for r in self._replicas)

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
            replica = self._placed(run_id) or self._least_loaded()
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
        for r in list(self._replicas):
            adapters = None
            if r.alive:
                try:
                    info = self._handle.info.remote(r.replica_id).result(timeout_s=INFO_TIMEOUT_S)
                    adapters = info["adapters"]
                except Exception:  # a dying or busy replica: listed without its adapters
                    logger.warning("replica %d did not describe itself", r.index)
            listing.append(
                {
                    "index": r.index,
                    "replica_id": r.replica_id,
                    "pid": r.pid,
                    "alive": r.alive,
                    "runs": sorted(r.runs),
                    "adapters": adapters,
                }
            )
        return listing

    def stop(self) -> None:
        from ray import serve

        import twinkle.infra

        live.subscribe(APP, None)
        for replica in self._replicas:
            replica.scheduler.stop()
        started = psutil.Process().children(recursive=True)  # Ray's processes: GCS, raylet and their agents
        try:
            serve.shutdown()
        finally:
            twinkle.infra.shutdown()  # ends the local Ray this process started
        # The raylet's agents can outlive it (seen with Ray 2.60): end whatever this server started and is left.
        _, alive = psutil.wait_procs(started, timeout=STOP_TIMEOUT_S)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def _wait_for_replicas(self, count: int) -> dict[str, Any]:
        """The first replica's ``info``, once ``count`` replicas are admitted."""
        info = self._handle.info.remote(None).result(timeout_s=START_TIMEOUT_S)
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._replicas) >= count, START_TIMEOUT_S):
                raise ServerError(f"{count} model replicas did not start in {START_TIMEOUT_S:.0f} s")
        return info

    def _on_replicas(self, replica_ids: list[str]) -> None:
        """The router's list of live replicas changed (on its thread, so no waiting here): admit new replicas
        (at start, and the replacements Serve starts), give up on vanished ones."""
        with self._lock:
            new = [replica_id for replica_id in replica_ids if replica_id not in self._known]
            self._known.update(new)
            gone = [r for r in self._replicas if r.alive and r.replica_id not in replica_ids]
        for replica_id in new:
            threading.Thread(target=self._admit, args=(replica_id,), name="twinkle-replica-admit", daemon=True).start()
        for replica in gone:
            threading.Thread(target=self._lost, args=(replica,), name="twinkle-replica-lost", daemon=True).start()

    def _admit(self, replica_id: str) -> None:
        try:
            info = self._handle.info.remote(replica_id).result(timeout_s=START_TIMEOUT_S)
        except Exception as error:  # it died before answering: the router will drop it
            logger.warning("replica %s did not answer: %s", replica_id, error)
            return
        with self._lock:
            scheduler = Scheduler(  # its calls go to ``replica``, bound on the next line
                lambda requests: self._run_batch(replica, requests), **self._scheduler_options
            )
            replica = _Replica(len(self._replicas), replica_id, info["pid"], scheduler)
            self._replicas.append(replica)
            self._lock.notify_all()
        logger.info("replica %d (%s, pid %d) is serving", replica.index, replica_id, replica.pid)

    def _placed(self, run_id: str) -> _Replica | None:
        return next((r for r in self._replicas if run_id in r.runs), None)

    def _least_loaded(self) -> _Replica:
        """The live replica with the fewest runs (under the lock)."""
        replica = min((r for r in self._replicas if r.alive), key=lambda r: len(r.runs), default=None)
        if replica is None:
            raise ServerError("every replica has died; restart the server")
        return replica

    def _route(self, key: str) -> _Replica:
        """The run's replica; calls not on a run (sampling the base model) go to the least-loaded live one."""
        with self._lock:
            return self._placed(key) or self._least_loaded()

    def _apply(self, replica: _Replica, key: str, task: Task) -> Any:
        return self._get(replica, self._handle.apply.remote(replica.replica_id, task), [key])

    def _run_batch(self, replica: _Replica, requests: list[SharedRequest]) -> list[AdapterResult] | list[SampleResult]:
        response = self._handle.run_batch.remote(replica.replica_id, requests)
        return self._get(replica, response, [str(request.adapter_name) for request in requests])

    def _get(self, replica: _Replica, response: Any, keys: list[str]) -> Any:
        """The call's result; the replica's exception as raised there; a clear error if the replica died."""
        from ray.exceptions import RayActorError, RayError, RayTaskError

        try:
            return response.result()
        except RayTaskError as error:
            raise (error.cause if not isinstance(error.cause, RayError) else RuntimeError(str(error))) from None
        except (RayActorError, live.ReplicaGoneError) as error:
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
        logger.error(
            "replica %d (pid %d) died; its runs %s are no longer loaded", replica.index, replica.pid, sorted(runs)
        )
        for run_id, user in runs.items():
            self._on_lost(user, run_id)
