"""The scheduler: one worker thread runs every tenant's calls, batching training steps across tenants.

Each run has a FIFO queue, so a tenant's calls run in the order sent. The
worker serves runs round-robin. When the run whose turn it is has a
``forward_backward`` at the head of its queue, the heads of the other runs
that are also ``forward_backward`` calls join it in one shared pass
(``MultiLoraModel.forward_backward_many``), up to a token budget
(``max_tokens_per_pass``; 0 never batches: each pass takes one request); runs
left out go first next time. A run may only ever contribute one request per pass,
so a tenant sending big batches cannot crowd out one sending small ones.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinkle.model import AdapterRequest
from twinkle.utils import get_logger

logger = get_logger(__name__)

SHARED_METHOD = "forward_backward"


@dataclass
class Job:
    """One call: ``run()`` executes it alone; a ``forward_backward`` job can also join a shared pass."""

    queue_key: str
    run: Callable[[], Any]
    on_done: Callable[[Any, BaseException | None], None]
    shared: AdapterRequest | None = None  # set when the job may be batched with other tenants
    tokens: int = 0
    labels: tuple[str, str] = ("", "")  # (user, method), for metrics
    submitted_at: float = field(default_factory=time.monotonic)


class Scheduler:
    """Runs :class:`Job` s on one worker thread; ``run_shared(requests)`` executes a shared pass."""

    def __init__(
        self,
        run_shared: Callable[[list[AdapterRequest]], list[Any]],
        max_tokens_per_pass: int = 32768,
        observe: Callable[[str, Job, float], None] | None = None,
        on_pass: Callable[[int], None] | None = None,
    ) -> None:
        self._run_shared = run_shared
        self.max_tokens_per_pass = max_tokens_per_pass
        self._observe = observe or (lambda event, job, seconds: None)
        self._on_pass = on_pass or (lambda requests: None)
        self._queues: dict[str, deque[Job]] = {}
        self._turn: deque[str] = deque()  # queue keys in round-robin order
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="twinkle-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            queue = self._queues.setdefault(job.queue_key, deque())
            if not queue and job.queue_key not in self._turn:
                self._turn.append(job.queue_key)
            queue.append(job)
            self._cond.notify()

    def queue_depth(self) -> int:
        with self._cond:
            return sum(len(queue) for queue in self._queues.values())

    def call(
        self, queue_key: str, run: Callable[[], Any], timeout: float | None = None, labels: tuple[str, str] = ("", "")
    ) -> Any:
        """Run ``run`` in the queue's order and wait for its result (for short calls)."""
        done = threading.Event()
        box: list[Any] = [None, None]

        def on_done(result: Any, error: BaseException | None) -> None:
            box[0], box[1] = result, error
            done.set()

        self.submit(Job(queue_key, run, on_done, labels=labels))
        if not done.wait(timeout):
            raise TimeoutError(f"the call on {queue_key!r} did not finish within {timeout} s")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._turn and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    self._fail_pending()
                    return
                batch = self._next_batch()
            self._execute(batch)

    def _next_batch(self) -> list[Job]:
        """Pop the jobs to run next (called with the lock held)."""
        key = self._turn[0]
        head = self._queues[key][0]
        if head.shared is None or self.max_tokens_per_pass == 0:  # 0: tenants never share a pass
            return [self._pop(key)]
        batch: list[Job] = []
        tokens = 0
        for other in list(self._turn):
            job = self._queues[other][0]
            if job.shared is None or (batch and tokens + job.tokens > self.max_tokens_per_pass):
                continue
            batch.append(self._pop(other))
            tokens += job.tokens
        return batch

    def _pop(self, key: str) -> Job:
        job = self._queues[key].popleft()
        self._turn.remove(key)
        if self._queues[key]:
            self._turn.append(key)  # back of the line
        else:
            del self._queues[key]
        return job

    def _execute(self, batch: list[Job]) -> None:
        started = time.monotonic()
        for job in batch:
            self._observe("start", job, started - job.submitted_at)
        if len(batch) == 1 and batch[0].shared is None:
            outcomes = [_outcome(batch[0].run)]
        else:
            self._on_pass(len(batch))
            try:
                results = self._run_shared([job.shared for job in batch])  # type: ignore[misc]
                outcomes = [(result.output, result.error) for result in results]
            except Exception as exc:  # the whole pass failed: every job in it reports it
                logger.exception("shared pass failed")
                outcomes = [(None, exc)] * len(batch)
        elapsed = time.monotonic() - started
        for job, (result, error) in zip(batch, outcomes, strict=True):
            self._observe("done", job, elapsed)
            try:
                job.on_done(result, error)
            except Exception:
                logger.exception("on_done of a job on %r failed", job.queue_key)

    def _fail_pending(self) -> None:
        for queue in self._queues.values():
            for job in queue:
                job.on_done(None, RuntimeError("the server shut down before this call ran"))
        self._queues.clear()
        self._turn.clear()


def _outcome(run: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return run(), None
    except Exception as exc:
        return None, exc
