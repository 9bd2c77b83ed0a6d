"""The scheduler keeps each run's order, batches tenants' training steps, and is fair to small tenants."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from twinkle.model import AdapterRequest
from twinkle.server.services.scheduler import Job, Scheduler


class Recorder:
    """A stand-in for the model: records which requests ran together."""

    def __init__(self) -> None:
        self.passes: list[list[str]] = []
        self.singles: list[str] = []

    def run_shared(self, requests):
        self.passes.append([request.adapter_name + ":" + str(request.inputs) for request in requests])
        return [SimpleNamespace(output=request.inputs, error=None) for request in requests]


def _shared(run: str, step: int, tokens: int = 10) -> Job:
    return Job(run, lambda: None, lambda result, error: None, shared=AdapterRequest(run, step), tokens=tokens)


def _blocked_scheduler(run_shared, **kwargs) -> tuple[Scheduler, threading.Event]:
    """A scheduler whose worker is busy until the returned event is set, so jobs queue up meanwhile."""
    scheduler = Scheduler(run_shared, **kwargs)
    gate, started = threading.Event(), threading.Event()
    scheduler.submit(Job("gate", lambda: (started.set(), gate.wait()), lambda result, error: None))
    started.wait()
    return scheduler, gate


def _drain(scheduler: Scheduler) -> None:
    scheduler.call("drain", lambda: None, timeout=30)
    scheduler.stop()


def test_training_steps_of_different_tenants_share_a_pass_in_each_tenants_order():
    recorder = Recorder()
    scheduler, gate = _blocked_scheduler(recorder.run_shared)
    for step in range(3):
        for run in ("a", "b", "c"):
            scheduler.submit(_shared(run, step))
    gate.set()
    _drain(scheduler)
    assert recorder.passes == [[f"{run}:{step}" for run in "abc"] for step in range(3)]


def test_a_tenant_with_big_batches_does_not_starve_one_with_small_batches():
    recorder = Recorder()
    scheduler, gate = _blocked_scheduler(recorder.run_shared, max_tokens_per_pass=100)
    for step in range(4):
        scheduler.submit(_shared("big", step, tokens=100))
    for step in range(4):
        scheduler.submit(_shared("small", step, tokens=5))
    gate.set()
    _drain(scheduler)
    order = [name for shared_pass in recorder.passes for name in shared_pass]
    # Over budget together, so they alternate: small never waits behind more than one big batch.
    assert order == [f"{run}:{step}" for step in range(4) for run in ("big", "small")]
    assert all(len(shared_pass) == 1 for shared_pass in recorder.passes)


def test_other_calls_keep_their_place_in_the_runs_queue():
    recorder, events = Recorder(), []
    scheduler, gate = _blocked_scheduler(recorder.run_shared)
    scheduler.submit(_shared("a", 0))
    scheduler.submit(Job("a", lambda: events.append("a:step"), lambda result, error: None))
    scheduler.submit(_shared("a", 1))
    scheduler.submit(_shared("b", 0))
    gate.set()
    _drain(scheduler)
    assert recorder.passes == [["a:0", "b:0"], ["a:1"]]
    assert events == ["a:step"]


def test_results_and_errors_reach_their_own_job():
    def run_shared(requests):
        return [
            SimpleNamespace(output=None, error=ValueError("bad"))
            if r.adapter_name == "bad"
            else SimpleNamespace(output=r.inputs * 2, error=None)
            for r in requests
        ]

    scheduler, gate = _blocked_scheduler(run_shared)
    outcomes = {}

    def record(run):
        return lambda result, error: outcomes.__setitem__(run, (result, error))

    for run in ("good", "bad"):
        scheduler.submit(Job(run, lambda: None, record(run), shared=AdapterRequest(run, 21)))
    gate.set()
    _drain(scheduler)
    assert outcomes["good"] == (42, None)
    assert isinstance(outcomes["bad"][1], ValueError)


def test_stopping_fails_what_is_still_queued():
    recorder = Recorder()
    scheduler, gate = _blocked_scheduler(recorder.run_shared)
    errors = []
    scheduler.submit(Job("a", lambda: None, lambda result, error: errors.append(error)))
    threading.Timer(0.2, gate.set).start()
    scheduler.stop()
    assert len(errors) == 1 and "shut down" in str(errors[0])
