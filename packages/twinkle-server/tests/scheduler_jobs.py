"""Jobs and a recording stand-in model for the scheduler's tests (imported by test_scheduler*.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import SimpleNamespace

from twinkle.server.services.scheduler import Job, Scheduler


@dataclass(frozen=True)
class Request:
    """What a shared job hands to ``run_shared`` (the scheduler treats it as opaque)."""

    run: str
    step: int


class Recorder:
    """A stand-in for the model: records which requests ran together."""

    def __init__(self) -> None:
        self.passes: list[list[str]] = []

    def run_shared(self, requests: list[Request]) -> list[SimpleNamespace]:
        self.passes.append([f"{request.run}:{request.step}" for request in requests])
        return [SimpleNamespace(output=request.step, error=None) for request in requests]


def shared_job(run: str, step: int, tokens: int = 10, on_done=lambda result, error: None) -> Job:
    return Job(run, lambda: None, on_done, shared=Request(run, step), tokens=tokens)


def blocked_scheduler(run_shared, **kwargs) -> tuple[Scheduler, threading.Event]:
    """A scheduler whose worker is busy until the returned event is set, so jobs queue up meanwhile."""
    scheduler = Scheduler(run_shared, **kwargs)
    gate, started = threading.Event(), threading.Event()
    scheduler.submit(Job("gate", lambda: (started.set(), gate.wait()), lambda result, error: None))
    started.wait()
    return scheduler, gate


def drain(scheduler: Scheduler, runs) -> None:
    """Wait until every job queued so far on ``runs`` is done (each run's queue is FIFO), then stop."""
    for run in runs:
        scheduler.call(run, lambda: None, timeout=30)
    scheduler.stop()


def train(scheduler: Scheduler, run: str, step: int) -> int:
    """Submit one shared training call and wait for its result, as a tenant's forward_backward does."""
    done, box = threading.Event(), []
    scheduler.submit(shared_job(run, step, on_done=lambda result, error: (box.append((result, error)), done.set())))
    assert done.wait(30), f"{run}:{step} was never trained"
    result, error = box[0]
    assert error is None
    return result
