"""Everything one server process holds, created at start-up and closed at shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from twinkle.server.app.telemetry import Telemetry
from twinkle.server.auth import sync_config_users
from twinkle.server.config import ServerConfig
from twinkle.server.quotas import QuotaChecker
from twinkle.server.services.batches import SAMPLE, batch_kind
from twinkle.server.services.checkpoints import Checkpoints
from twinkle.server.services.data import DataHandles
from twinkle.server.services.engine import Engine, LocalEngine
from twinkle.server.services.futures import Futures
from twinkle.server.services.pool import ModelPool
from twinkle.server.services.scheduler import Scheduler
from twinkle.server.store import SQLiteStore, Store
from twinkle.utils import get_logger

logger = get_logger(__name__)

RESTART_REASON = "the server restarted while this call was in flight; resume from your last checkpoint"


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    engine: Engine  # where runs' calls execute: this process, or Ray replicas (``config.ray``)
    futures: Futures
    data: DataHandles
    quotas: QuotaChecker
    telemetry: Telemetry
    checkpoints: Checkpoints  # both APIs' checkpoints; its reaper deletes expired ones while the server runs
    # Called with a run id once the run's adapter left its pool; the engine still routes the run's key to its replica.
    release_hooks: list[Callable[[str], None]] = field(default_factory=list)
    _reaper_stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, config: ServerConfig, store: Store | None = None) -> ServerState:
        store = store or SQLiteStore(config.database)
        failed = store.mark_inflight_futures_failed(RESTART_REASON)
        store.mark_all_runs_nonresident()  # the new process's adapter pool is empty
        sync_config_users(store, config)
        if failed:
            logger.warning("%d calls were in flight when the server stopped; they now report a failure", failed)
        telemetry = Telemetry()
        if config.ray:
            from twinkle.server.services.serve.engine import ServeEngine  # imports Ray only when asked for

            engine: Engine

            def on_lost(user: str, run_id: str) -> None:
                store.set_resident(user, run_id, False)

            engine = ServeEngine(config, telemetry.observe_job, telemetry.observe_pass, on_lost)
        else:
            pool = ModelPool(config.model_id, config.max_loras, config.max_rank, config.device, config.model_options)
            scheduler = Scheduler(
                pool.run_batch,
                max_tokens_per_pass=config.max_tokens_per_pass,
                batch_budgets={SAMPLE: config.max_tokens_per_sample_batch},
                cycle_wait_s=config.cycle_wait_s,
                observe=telemetry.observe_job,
                on_pass=telemetry.observe_pass,
                batch_kind=batch_kind,
            )
            engine = LocalEngine(pool, scheduler)
        telemetry.bind_engine(engine)
        checkpoints = Checkpoints(store, config.checkpoint_dir, config.checkpoint_sweep_interval_s)
        state = cls(
            config,
            store,
            engine,
            Futures(store),
            DataHandles(engine.model_path),
            QuotaChecker(config),
            telemetry,
            checkpoints,
        )
        threading.Thread(target=state._reap_sessions, name="twinkle-session-reaper", daemon=True).start()
        checkpoints.start()
        return state

    def release_run(self, user: str, run_id: str) -> None:
        """Take a run's adapter out of the pool (memory freed); its checkpoints stay."""

        def after(run_id: str) -> None:
            for hook in self.release_hooks:
                hook(run_id)

        self.engine.remove_run(user, run_id, after, timeout=600)
        self.store.set_resident(user, run_id, False)

    def close_session(self, user: str, session_id: str) -> bool:
        """Close a session: its runs' adapters leave the pool; False if it is unknown or another user's."""
        released = self.store.close_session(user, session_id)
        if released is None:
            return False
        for run_id in released:
            self.release_run(user, run_id)
        if self.store.count_resident_runs(user) == 0:
            self.data.drop_user(user)  # nothing left training: free the user's server-side datasets
        return True

    def stop(self) -> None:
        self._reaper_stop.set()
        self.checkpoints.stop()
        self.engine.stop()
        self.store.close()

    def _reap_sessions(self) -> None:
        """Sessions without a heartbeat for ``session_timeout_s`` close, and their adapters leave the pool."""
        interval = max(1.0, min(30.0, self.config.session_timeout_s / 4))
        while not self._reaper_stop.wait(interval):
            for session in self.store.stale_sessions(time.time() - self.config.session_timeout_s):
                try:
                    self.close_session(session.user, session.id)
                except Exception:
                    logger.exception("could not close expired session %s", session.id)
