"""Shared calls of another kind than training (the server's sample calls) batch apart, fairly, and never wait."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from twinkle.server.services.scheduler import Job

sys.path.insert(0, str(Path(__file__).parent))
from scheduler_jobs import Recorder, Request, blocked_scheduler, drain, shared_job  # beside this file


@dataclass(frozen=True)
class Sample:
    """A shared request of another batch kind (as the server's sample calls are)."""

    run: str
    step: int


def _kind(request: Request | Sample) -> str:
    return "sample" if isinstance(request, Sample) else "pass"


def test_shared_calls_of_another_kind_batch_apart_from_training():
    """Sample calls of four queues (four tenants) run in one batch of their own;
    training calls share passes of theirs; batches go in turn order."""
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared, batch_kind=_kind)
    for run in ("a", "b"):
        scheduler.submit(shared_job(run, 0))
    for number in range(4):
        scheduler.submit(Job(f"s{number}", lambda: None, lambda result, error: None, shared=Sample("s", number)))
    scheduler.submit(shared_job("c", 0))
    gate.set()
    drain(scheduler, ["a", "b", "c", "s0", "s1", "s2", "s3"])
    assert recorder.passes == [["a:0", "b:0", "c:0"], ["s:0", "s:1", "s:2", "s:3"]]


def test_a_sample_batch_takes_each_queue_in_turn_within_its_budget():
    """a sends 5 sample calls at once (one queue, in order), b one: the batch takes a call of each queue per
    round until its budget (40 tokens, 10 each) is spent, so a's calls batch together without crowding out
    b's; the rest go in the next batch. With a budget of 0 every call runs alone."""
    for budget, expected in (
        (40, [["a:0", "b:0", "a:1", "a:2"], ["a:3", "a:4"]]),
        (0, [["a:0"], ["b:0"], ["a:1"], ["a:2"], ["a:3"], ["a:4"]]),
    ):
        recorder = Recorder()
        scheduler, gate = blocked_scheduler(recorder.run_shared, batch_kind=_kind, batch_budgets={"sample": budget})
        for run, step in [("a", step) for step in range(5)] + [("b", 0)]:
            scheduler.submit(Job(run, lambda: None, lambda result, error: None, shared=Sample(run, step), tokens=10))
        gate.set()
        drain(scheduler, "ab")
        assert recorder.passes == expected, budget


def test_a_sample_batch_runs_while_a_pass_waits_for_tenants():
    """a is back for its next pass, which waits (up to 5 s) for b, its partner of the last pass: a sample call
    arriving meanwhile runs at once instead of queueing behind it."""
    recorder, sampled, trained = Recorder(), threading.Event(), threading.Event()
    scheduler, gate = blocked_scheduler(recorder.run_shared, cycle_wait_s=5.0, batch_kind=_kind)
    for run in ("a", "b"):
        scheduler.submit(shared_job(run, 0))
    gate.set()
    scheduler.submit(shared_job("a", 1, on_done=lambda result, error: trained.set()))
    time.sleep(0.2)  # the pass of a:1 is waiting for b now
    scheduler.submit(Job("s0", lambda: None, lambda result, error: sampled.set(), shared=Sample("s", 0)))
    assert sampled.wait(2.0), "the sample call waited behind the training pass"
    assert not trained.is_set()
    scheduler.submit(shared_job("b", 1))
    assert trained.wait(30)
    drain(scheduler, ["a", "b", "s0"])
    assert recorder.passes == [["a:0", "b:0"], ["s:0"], ["a:1", "b:1"]]
