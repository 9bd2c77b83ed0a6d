"""The scheduler: one worker thread runs every tenant's calls in clock cycles, batching training across tenants.

Each run has a FIFO queue, so a tenant's calls run in the order sent. The
worker runs in cycles, as Tinker's own service does:

1. **Pass.** The runs whose queue head is a shareable call (a :class:`Job`
   with ``shared`` set: ``forward_backward``, ``forward_only``) run in one
   shared pass (``run_shared``), up to a token budget (``max_tokens_per_pass``;
   0 never batches: each pass takes one request). A run contributes at most one
   request per pass, so a tenant sending big batches cannot crowd out one
   sending small ones; runs left out by the budget go first in the next cycle.
   Shared requests of another kind (``batch_kind``: sample calls) form batches
   of their own, which never wait for anyone: round by round, the next call of
   each queue whose head is of that kind, until the kind's budget
   (``batch_budgets``) is spent. So a tenant's many concurrent calls (one
   queue) batch together, and each other tenant's calls get as many places.
2. **Steps.** Then every run whose head is another call (an optimizer step,
   ``save``, ...) runs that call, one per run, back to back, and their
   results are delivered together at the end. The runs of a shared pass
   whose steps are on their way are waited for while calls keep coming in
   (``STEP_GATHER_S``; ``cycle_wait_s`` after the pass at most): a step run
   while the server handles the other tenants' requests is several times
   slower, as the two take turns with the interpreter lock at every torch op.

Tenants send their next training call only once their step is answered, so a
pass could start before they are back. When a pass is about to start and runs
of recent passes are on their way back (:mod:`expected_runs` says which), the
pass waits for them: the worker runs their optimizer steps meanwhile, and
starts as soon as they all have a training call queued, or once it has waited
with nothing to run for ``cycle_wait_s``. A run training alone never waits:
there is no other run to wait for.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from twinkle.server.services.expected_runs import PAUSE_S, ExpectedRuns
from twinkle.utils import get_logger

logger = get_logger(__name__)

STEP_GATHER_S = 0.01  # the step phase waits for steps on their way until no call came in for this long
TRAINING = "pass"  # the batch kind of training calls, the only kind whose passes wait for tenants on their way back


@dataclass
class Job:
    """One call: ``run()`` executes it alone; a job with ``shared`` set joins a shared pass instead."""

    queue_key: str
    run: Callable[[], Any]
    on_done: Callable[[Any, BaseException | None], None]
    # The request handed to ``run_shared`` (e.g. an ``AdapterRequest``); set when the job may be batched.
    shared: Any = None
    tokens: int = 0
    labels: tuple[str, str] = ("", "")  # (user, method), for metrics
    submitted_at: float = field(default_factory=time.monotonic)


Outcome = tuple[Job, Any, BaseException | None, float]  # a job, its result, its error, its seconds


class Scheduler:
    """Runs :class:`Job` s on one worker thread.

    ``run_shared(requests)`` executes a shared pass and returns one result per
    request, each with ``output`` and ``error``.
    """

    def __init__(
        self,
        run_shared: Callable[[list[Any]], list[Any]],
        max_tokens_per_pass: int = 32768,
        observe: Callable[[str, Job, float], None] | None = None,
        on_pass: Callable[[list[Job]], None] | None = None,
        cycle_wait_s: float = 0.05,
        batch_kind: Callable[[Any], str] = lambda request: TRAINING,
        batch_budgets: Mapping[str, int] | None = None,
    ) -> None:
        if max_tokens_per_pass < 0 or cycle_wait_s < 0:
            raise ValueError(
                f"max_tokens_per_pass and cycle_wait_s must be >= 0, got {max_tokens_per_pass} and {cycle_wait_s}"
            )
        self._run_shared = run_shared
        self._batch_kind = batch_kind
        self._budgets = dict(batch_budgets or {})  # other kinds' token budgets (default: max_tokens_per_pass)
        self.max_tokens_per_pass = max_tokens_per_pass
        self.cycle_wait_s = cycle_wait_s
        self._observe = observe or (lambda event, job, seconds: None)
        self._on_pass = on_pass or (lambda jobs: None)
        self._queues: dict[str, deque[Job]] = {}
        self._turn: deque[str] = deque()  # keys of runs with queued jobs, in the order they are served
        self._stepping: deque[str] = deque()  # runs whose head call runs in the current step phase
        self._step_due = False  # a pass just ran: its step phase comes next
        self._last_submitted = self._pass_ended = time.monotonic()
        self._held: list[Outcome] = []  # a pass's results answered after the next calls (``_deliver``)
        self._expected = ExpectedRuns(cycle_wait_s)  # whom a pass waits for
        self._cond = threading.Condition()
        self._stopping = False
        self._busy_s = 0.0  # written by the scheduler thread only
        self._thread = threading.Thread(target=self._loop, name="twinkle-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._last_submitted = time.monotonic()
            queue = self._queues.setdefault(job.queue_key, deque())
            if not queue and job.queue_key not in self._turn:
                self._turn.append(job.queue_key)
            queue.append(job)
            self._cond.notify()

    def queue_depth(self) -> int:
        with self._cond:
            return sum(len(queue) for queue in self._queues.values())

    def busy_seconds(self) -> float:
        """Seconds spent running calls so far, a shared pass counted once: the rest of the time it waited."""
        return self._busy_s

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
                jobs = self._next_jobs()
                if jobs is None:
                    self._fail_pending()
            if jobs is None:
                self._deliver([])  # results held back are answered still
                return
            if jobs[0].shared is None:
                self._run_calls(jobs)
            else:
                self._run_pass(jobs)

    def _next_jobs(self) -> list[Job] | None:
        """Wait for and pop what runs next: calls to run back to back, or a shared pass; None once stopping (lock
        held)."""
        while not self._stopping:
            if self._step_due:  # the pass is done: the cycle's step phase takes the heads there are now
                heads = self._waiting_keys(shared=False)
                if self._gathering_left(heads) <= 0:  # else it waits below for the steps on their way
                    self._step_due = False
                    self._stepping.extend(heads)
            if self._stepping:  # the step phase's calls, run back to back
                keys = list(self._stepping)
                self._stepping.clear()
                for key in keys:
                    self._expected.ran_call(key)
                return [self._pop(key) for key in keys]
            shared = self._waiting_keys(shared=True)
            training = [key for key in shared if self._kind(key) == TRAINING]
            others = [key for key in shared if key not in training]
            if others and (not training or shared[0] in others):  # first in turn
                return self._other_batch(others)
            batch = self._fill_pass(training)
            if batch:
                awaited = self._awaited(training, batch)
                if not awaited:
                    self._expected.trained(batch)
                    self._step_due = True
                    return [self._pop(key) for key in batch]
                steps = [key for key in awaited if key in self._queues and self._queues[key][0].shared is None]
                gathering = self._gathering_left(steps)
                if gathering <= 0:  # their steps (a shared call of theirs joins its own kind's batch)
                    self._stepping.extend(steps)
                if others and not self._stepping:  # batches of another kind run meanwhile too
                    return self._other_batch(others)
                if not self._stepping:
                    started = time.monotonic()
                    wait = self._expected.wait_left(awaited)
                    self._cond.wait(min(wait, gathering) if gathering > 0 else wait)
                    self._expected.waited(awaited, time.monotonic() - started)
                continue
            others = self._waiting_keys(shared=False)
            gathering = self._gathering_left(others)
            if others and gathering <= 0:  # no training call queued: the other calls run
                self._stepping.extend(others)
                continue
            started = time.monotonic()
            self._cond.wait(gathering if gathering > 0 else None)
            if time.monotonic() - started >= PAUSE_S:
                self._expected.paused()
        return None

    def _gathering_left(self, steps: list[str]) -> float:
        """Seconds the queued ``steps`` (the calls of runs of the last shared pass) may still wait for the other
        runs of that pass on their way with their steps, to run together; 0 or less: run them now.

        One by one, each step would compete for the interpreter lock with the server's handling of the other
        tenants' requests (every torch op lets go of it), which makes a step several times slower. The wait
        ends once no call has come in for ``STEP_GATHER_S``, and ``cycle_wait_s`` after the pass at the latest.
        """
        if not steps or self.max_tokens_per_pass == 0 or not all(self._expected.in_last_pass(k) for k in steps):
            return 0.0
        if not self._expected.stepping(self._queues):
            return 0.0
        now = time.monotonic()
        return min(STEP_GATHER_S - (now - self._last_submitted), self.cycle_wait_s - (now - self._pass_ended))

    def _waiting_keys(self, shared: bool) -> list[str]:
        """The runs, in turn order, whose head job is (``shared``) or is not a shareable training call."""
        return [key for key in self._turn if (self._queues[key][0].shared is not None) == shared]

    def _kind(self, key: str) -> str:
        """The batch kind of the run's head job (a shareable one)."""
        return self._batch_kind(self._queues[key][0].shared)

    def _other_batch(self, keys: list[str]) -> list[Job]:
        """Pop a batch of the first of ``keys``' kind (not training): round by round, the next job of each queue
        whose head is of that kind, within the kind's budget (the first job always); the step phase comes next."""
        kind = self._kind(keys[0])
        budget = self.max_tokens_per_pass and self._budgets.get(kind, self.max_tokens_per_pass)  # 0: one per batch
        jobs: list[Job] = []
        tokens = 0
        rounds = [key for key in keys if self._kind(key) == kind]
        while rounds:
            for key in list(rounds):
                queue = self._queues.get(key)
                if not queue or queue[0].shared is None or self._batch_kind(queue[0].shared) != kind:
                    rounds.remove(key)
                    continue
                if jobs and (budget == 0 or tokens + queue[0].tokens > budget):
                    rounds.clear()  # full: the rest go first next time
                    break
                tokens += queue[0].tokens
                jobs.append(self._pop(key))
        self._step_due = True
        return jobs

    def _fill_pass(self, shared: list[str]) -> list[str]:
        """The runs of the next pass: the first shareable head, then each other that fits the token budget."""
        if not shared or self.max_tokens_per_pass == 0:  # 0: tenants never share a pass
            return shared[:1]
        batch: list[str] = []
        tokens = 0
        for key in shared:
            job_tokens = self._queues[key][0].tokens
            if not batch or tokens + job_tokens <= self.max_tokens_per_pass:
                batch.append(key)
                tokens += job_tokens
        return batch

    def _awaited(self, shared: list[str], batch: list[str]) -> list[str]:
        """The runs the coming pass waits for (see :mod:`expected_runs`), unless it is full already."""
        if len(batch) < len(shared) or self.max_tokens_per_pass == 0:
            return []
        return self._expected.awaited(set(shared), self._queues)

    def _pop(self, key: str) -> Job:
        job = self._queues[key].popleft()
        self._turn.remove(key)
        if self._queues[key]:
            self._turn.append(key)  # back of the line
        else:
            del self._queues[key]
        return job

    def _run_calls(self, jobs: list[Job]) -> None:
        """Run calls one after another, then deliver their results: a result delivered at once would have the
        server's reply to it compete with the next call for the interpreter lock."""
        outcomes: list[Outcome] = []
        for job in jobs:
            started = time.monotonic()
            self._observe("start", job, started - job.submitted_at)
            result, error = _outcome(job.run)
            elapsed = time.monotonic() - started
            self._busy_s += elapsed
            outcomes.append((job, result, error, elapsed))
        self._deliver(outcomes)

    def _run_pass(self, batch: list[Job]) -> None:
        started = time.monotonic()
        for job in batch:
            self._observe("start", job, started - job.submitted_at)
        self._on_pass(batch)
        try:
            results = self._run_shared([job.shared for job in batch])
            outcomes = [(result.output, result.error) for result in results]
        except Exception as exc:  # the whole pass failed: every job in it reports it
            logger.exception("shared pass failed")
            outcomes = [(None, exc)] * len(batch)
        self._pass_ended = time.monotonic()
        elapsed = self._pass_ended - started
        self._busy_s += elapsed
        with self._cond:  # runs whose next call is queued already run it in the step phase that comes next
            next_queued = set(self._waiting_keys(shared=False))
        done = [(job, result, error, elapsed) for job, (result, error) in zip(batch, outcomes, strict=True)]
        self._deliver([outcome for outcome in done if outcome[0].queue_key not in next_queued])
        self._held = [outcome for outcome in done if outcome[0].queue_key in next_queued]

    def _deliver(self, outcomes: list[Outcome]) -> None:
        """Answer the results held back from the last pass, then ``outcomes``.

        A pass's result is held back while its run's next call is queued already (a Tinker client sends its
        optimizer step with its training call): answering it would have the server's reply compete with the
        step phase for the interpreter lock, and the client waits for the step's result too.
        """
        held, self._held = self._held, []
        for job, result, error, elapsed in held + outcomes:
            self._finish(job, result, error, elapsed)

    def _finish(self, job: Job, result: Any, error: BaseException | None, elapsed: float) -> None:
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
        self._stepping.clear()


def _outcome(run: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return run(), None
    except Exception as exc:
        return None, exc
