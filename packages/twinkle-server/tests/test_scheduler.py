"""The scheduler keeps each run's order, trains tenants in lock-step cycles of shared passes, and is fair."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from twinkle.server.services import scheduler as scheduler_module
from twinkle.server.services.expected_runs import PAUSE_S, REMEMBERED_PASSES
from twinkle.server.services.scheduler import Job, Scheduler

sys.path.insert(0, str(Path(__file__).parent))
from scheduler_jobs import Recorder, Request, blocked_scheduler, drain, shared_job, train  # beside this file


def test_training_steps_of_different_tenants_share_a_pass_in_each_tenants_order():
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared)
    for step in range(3):
        for run in ("a", "b", "c"):
            scheduler.submit(shared_job(run, step))
    gate.set()
    drain(scheduler, "abc")
    assert recorder.passes == [[f"{run}:{step}" for run in "abc"] for step in range(3)]


def test_tenants_stepping_between_training_calls_stay_in_step_and_fill_every_pass():
    """4 tenants alternate a training call and an optimizer step, each waiting for its answers and pausing at
    random as a client between round trips does: every pass holds all 4, at the same step, and the wait for
    a tenant ends when it is back (far sooner than ``cycle_wait_s``)."""
    recorder, runs, steps = Recorder(), ("a", "b", "c", "d"), 12
    scheduler, gate = blocked_scheduler(recorder.run_shared, cycle_wait_s=5.0)
    first_submitted = threading.Barrier(len(runs) + 1)
    optimizer_steps: dict[str, list[int]] = {run: [] for run in runs}
    failures: list[BaseException] = []

    def tenant(run: str, seed: int) -> None:
        rng = random.Random(seed)
        try:
            first = threading.Event()  # the first calls queue behind the gate, so the first pass holds everyone
            scheduler.submit(shared_job(run, 0, on_done=lambda result, error: first.set()))
            first_submitted.wait()
            assert first.wait(30)
            for step in range(steps):
                if step > 0:
                    assert train(scheduler, run, step) == step
                time.sleep(rng.uniform(0, 0.003))
                scheduler.call(run, lambda step=step: optimizer_steps[run].append(step), timeout=30)
                time.sleep(rng.uniform(0, 0.003))
        except BaseException as error:  # surfaced by the main thread
            failures.append(error)

    threads = [threading.Thread(target=tenant, args=(run, seed)) for seed, run in enumerate(runs)]
    for thread in threads:
        thread.start()
    first_submitted.wait()
    started = time.monotonic()
    gate.set()
    for thread in threads:
        thread.join(60)
    elapsed = time.monotonic() - started
    drain(scheduler, runs)
    assert failures == []
    assert [sorted(shared_pass) for shared_pass in recorder.passes] == [
        [f"{run}:{step}" for run in runs] for step in range(steps)
    ]
    assert optimizer_steps == {run: list(range(steps)) for run in runs}
    assert elapsed < 4.0, f"{steps} cycles took {elapsed:.1f} s: the waits did not end when the tenants were back"


def test_a_tenant_training_alone_never_waits():
    recorder, waits = Recorder(), []

    def observe(event: str, job: Job, seconds: float) -> None:
        if event == "start" and job.shared is not None:
            waits.append(seconds)

    scheduler = Scheduler(recorder.run_shared, cycle_wait_s=5.0, observe=observe)
    scheduler.call("sampler", lambda: None, timeout=30)  # a run that never trains is nobody to wait for
    started = time.monotonic()
    for step in range(3):
        assert train(scheduler, "solo", step) == step
        scheduler.call("solo", lambda: None, timeout=30)  # its optimizer step
    elapsed = time.monotonic() - started
    drain(scheduler, ["solo"])
    assert recorder.passes == [["solo:0"], ["solo:1"], ["solo:2"]]
    assert elapsed < 2.0 and max(waits) < 1.0, f"alone, 3 steps took {elapsed:.2f} s (waits {waits})"


def test_a_pass_waits_for_the_tenants_of_recent_passes_until_they_are_back_or_waited_out_once():
    recorder, waits = Recorder(), {}

    def observe(event: str, job: Job, seconds: float) -> None:
        if event == "start" and job.shared is not None:
            waits[f"{job.shared.run}:{job.shared.step}"] = seconds

    scheduler, gate = blocked_scheduler(recorder.run_shared, cycle_wait_s=1.0, observe=observe)
    for run in ("a", "b"):
        scheduler.submit(shared_job(run, 0))
    gate.set()
    trained = threading.Event()
    scheduler.submit(shared_job("a", 1, on_done=lambda result, error: trained.set()))
    threading.Timer(0.1, lambda: scheduler.submit(shared_job("b", 1))).start()
    assert trained.wait(30)  # a waited for b, back after 0.1 s
    assert train(scheduler, "a", 2) == 2  # b went away: a waits it out once
    assert train(scheduler, "a", 3) == 3  # and then no more
    drain(scheduler, "ab")
    assert recorder.passes == [["a:0", "b:0"], ["a:1", "b:1"], ["a:2"], ["a:3"]]
    assert 0.1 <= waits["a:1"] < 0.9 and waits["a:2"] >= 1.0 and waits["a:3"] < 0.9, waits


def _resume_after_pause(scheduler: Scheduler, c_step: int) -> None:
    """c is back first with its step ``c_step``, a and b (their step 1) 0.1 s and 0.2 s later; then stop."""
    trained = threading.Event()
    scheduler.submit(shared_job("c", c_step, on_done=lambda result, error: trained.set()))
    threading.Timer(0.1, lambda: scheduler.submit(shared_job("a", 1))).start()
    threading.Timer(0.2, lambda: scheduler.submit(shared_job("b", 1))).start()
    assert trained.wait(30)
    drain(scheduler, "abc")


def test_tenants_resuming_together_after_a_pause_train_in_one_pass():
    """A pause with no training call queued uses up no wait: the first tenant back waits for the others."""
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared, cycle_wait_s=1.0)
    for run in "abc":
        scheduler.submit(shared_job(run, 0))
    gate.set()
    for run in "abc":
        scheduler.call(run, lambda: None, timeout=30)  # their steps, then a pause
    time.sleep(0.3)
    _resume_after_pause(scheduler, c_step=1)
    assert [sorted(shared_pass) for shared_pass in recorder.passes] == [["a:0", "b:0", "c:0"], ["a:1", "b:1", "c:1"]]


def test_after_a_pause_tenants_waited_out_before_it_are_waited_for_again():
    """c trained once more than a and b (it was a step behind), waiting them out; after a pause they all
    start again, and the first pass waits for a and b again."""
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared, cycle_wait_s=0.5)
    for run in "abc":
        scheduler.submit(shared_job(run, 0))
    gate.set()
    assert train(scheduler, "c", 1) == 1  # waits a and b out
    time.sleep(PAUSE_S + 0.2)
    _resume_after_pause(scheduler, c_step=2)
    assert [sorted(shared_pass) for shared_pass in recorder.passes] == [
        ["a:0", "b:0", "c:0"],
        ["c:1"],
        ["a:1", "b:1", "c:2"],
    ]


def test_a_tenant_absent_from_the_remembered_passes_is_not_waited_for_after_a_pause():
    recorder, waits = Recorder(), []

    def observe(event: str, job: Job, seconds: float) -> None:
        if event == "start" and job.shared is not None:
            waits.append(seconds)

    scheduler, gate = blocked_scheduler(recorder.run_shared, cycle_wait_s=0.5, observe=observe)
    for run in ("a", "b"):
        scheduler.submit(shared_job(run, 0))
    gate.set()
    for step in range(1, REMEMBERED_PASSES + 1):  # b went away: the first of these waits it out
        assert train(scheduler, "a", step) == step
    time.sleep(PAUSE_S + 0.2)
    assert train(scheduler, "a", REMEMBERED_PASSES + 1) == REMEMBERED_PASSES + 1
    drain(scheduler, "ab")
    assert waits[2] >= 0.5 and max(waits[3:]) < 0.45, waits  # waits[:2]: the first pass, a and b


def test_after_a_pause_tenants_back_wait_for_their_partners_only():
    """a and b trained together, then c and d; after a pause a and b are back: their passes wait for neither
    c nor d (they trained apart); after another pause c, back alone, waits for d."""
    recorder, waits = Recorder(), {}

    def observe(event: str, job: Job, seconds: float) -> None:
        if event == "start" and job.shared is not None:
            waits[f"{job.shared.run}:{job.shared.step}"] = seconds

    scheduler, gate = blocked_scheduler(recorder.run_shared, max_tokens_per_pass=100, cycle_wait_s=1.0, observe=observe)
    for run in "abcd":
        scheduler.submit(shared_job(run, 0, tokens=40))  # the token budget takes two per pass
    gate.set()
    for run in "abcd":
        scheduler.call(run, lambda: None, timeout=30)
    time.sleep(PAUSE_S + 0.2)
    for step in (1, 2):  # and they go on training together, waiting for no one
        done = threading.Event()
        scheduler.submit(shared_job("a", step))
        scheduler.submit(shared_job("b", step, on_done=lambda result, error, done=done: done.set()))
        assert done.wait(30)
    time.sleep(PAUSE_S + 0.2)
    trained = threading.Event()
    scheduler.submit(shared_job("c", 1, on_done=lambda result, error: trained.set()))
    threading.Timer(0.3, lambda: scheduler.submit(shared_job("d", 1))).start()
    assert trained.wait(30)
    drain(scheduler, "abcd")
    assert [sorted(shared_pass) for shared_pass in recorder.passes] == [
        ["a:0", "b:0"],
        ["c:0", "d:0"],
        ["a:1", "b:1"],
        ["a:2", "b:2"],
        ["c:1", "d:1"],
    ]
    assert max(waits["a:1"], waits["a:2"]) < 0.5 and 0.3 <= waits["c:1"] < 0.9, waits


def _after_a_pass_of(runs: str, **options) -> tuple[Scheduler, Recorder]:
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared, **options)
    for run in runs:
        scheduler.submit(shared_job(run, 0))
    gate.set()
    return scheduler, recorder


def _step(scheduler: Scheduler, run: str, events: list[str], done: threading.Event | None = None) -> None:
    def on_done(result, error) -> None:
        events.append(f"{run} answered")
        if done is not None:
            done.set()

    scheduler.submit(Job(run, lambda: events.append(f"{run} stepped"), on_done))


def test_the_steps_of_a_shared_pass_run_back_to_back_once_all_are_in_and_are_answered_together(monkeypatch):
    """One by one, each step would compete with the server's handling of the other tenants' requests."""
    monkeypatch.setattr(scheduler_module, "STEP_GATHER_S", 1.0)  # a slow machine's timers stay within it
    scheduler, recorder = _after_a_pass_of("abc", cycle_wait_s=5.0)
    events: list[str] = []
    last = threading.Event()
    _step(scheduler, "a", events)
    threading.Timer(0.05, _step, (scheduler, "b", events)).start()
    threading.Timer(0.1, _step, (scheduler, "c", events, last)).start()
    assert last.wait(30)
    drain(scheduler, "abc")
    assert recorder.passes == [["a:0", "b:0", "c:0"]]
    assert events == ["a stepped", "b stepped", "c stepped", "a answered", "b answered", "c answered"]


def test_a_pass_result_whose_step_is_queued_already_is_answered_after_the_step_phase():
    """As a Tinker client sends its optimizer step with its training call: answering the result at once would
    compete with the step phase; c, whose step is not sent yet, needs its result first."""
    recorder, events = Recorder(), []
    scheduler, gate = blocked_scheduler(recorder.run_shared)
    for run in "ab":
        scheduler.submit(shared_job(run, 0, on_done=lambda result, error, run=run: events.append(f"{run} trained")))
        _step(scheduler, run, events)
    scheduler.submit(shared_job("c", 0, on_done=lambda result, error: events.append("c trained")))
    gate.set()
    drain(scheduler, "abc")
    assert recorder.passes == [["a:0", "b:0", "c:0"]]
    assert events == ["c trained", "a stepped", "b stepped", "a trained", "b trained", "a answered", "b answered"]


@pytest.mark.parametrize(
    ("gather_s", "cycle_wait_s", "low", "high"),
    [(0.2, 2.0, 0.2, 0.9), (5.0, 0.5, 0.4, 2.0)],  # no call came in for STEP_GATHER_S; cycle_wait_s at the latest
    ids=["quiet", "cycle"],
)
def test_a_step_waits_briefly_for_a_tenant_that_does_not_step_and_leaves_the_pass_its_wait(
    monkeypatch, gather_s, cycle_wait_s, low, high
):
    monkeypatch.setattr(scheduler_module, "STEP_GATHER_S", gather_s)
    waits = {}

    def observe(event: str, job: Job, seconds: float) -> None:
        if event == "start" and job.shared is not None:
            waits[f"{job.shared.run}:{job.shared.step}"] = seconds

    scheduler, recorder = _after_a_pass_of("ab", cycle_wait_s=cycle_wait_s, observe=observe)
    started = time.monotonic()
    scheduler.call("a", lambda: None, timeout=30)  # its step: b never steps
    assert low <= time.monotonic() - started < high
    assert train(scheduler, "a", 1) == 1  # the pass still waits b out, once
    drain(scheduler, "ab")
    assert recorder.passes == [["a:0", "b:0"], ["a:1"]] and waits["a:1"] >= cycle_wait_s, waits


def test_a_pass_waits_for_one_step_of_a_tenant_not_for_what_it_does_after():
    """b trained in the last pass, then queued two other calls: the pass waits for b's step, not its next call."""
    events: list[str] = []

    def run_shared(requests: list[Request]) -> list[SimpleNamespace]:
        events.append("+".join(f"{request.run}:{request.step}" for request in requests))
        return [SimpleNamespace(output=None, error=None) for _ in requests]

    scheduler, gate = blocked_scheduler(run_shared, cycle_wait_s=5.0)
    for job in (shared_job("a", 0), shared_job("b", 0), shared_job("a", 1)):
        scheduler.submit(job)
    for call in ("b:step", "b:sample"):
        scheduler.submit(Job("b", lambda call=call: events.append(call), lambda result, error: None))
    started = time.monotonic()
    gate.set()
    drain(scheduler, "ab")
    assert events == ["a:0+b:0", "b:step", "a:1", "b:sample"]
    assert time.monotonic() - started < 2.5


def test_busy_seconds_count_a_shared_pass_once_and_never_the_idle_time():
    at_pass_start = []

    def run_shared(requests):
        at_pass_start.append(scheduler.busy_seconds())  # the gate's call is counted by now
        time.sleep(0.15)
        return [SimpleNamespace(output=None, error=None) for _ in requests]

    scheduler, gate = blocked_scheduler(run_shared)
    for run in "abc":
        scheduler.submit(shared_job(run, 0))
    gate.set()
    for run in "abc":
        scheduler.call(run, lambda: None, timeout=30)
    busy = scheduler.busy_seconds()
    time.sleep(0.2)  # idle: waiting for calls is not busy
    assert scheduler.busy_seconds() == busy
    scheduler.stop()
    assert len(at_pass_start) == 1
    assert 0.15 <= busy - at_pass_start[0] < 0.45  # once, not once per tenant in the pass


def test_a_tenant_with_big_batches_does_not_starve_one_with_small_batches():
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared, max_tokens_per_pass=100)
    for step in range(4):
        scheduler.submit(shared_job("big", step, tokens=100))
    for step in range(4):
        scheduler.submit(shared_job("small", step, tokens=5))
    gate.set()
    drain(scheduler, ["big", "small"])
    order = [name for shared_pass in recorder.passes for name in shared_pass]
    # Over budget together, so they alternate: small never waits behind more than one big batch.
    assert order == [f"{run}:{step}" for step in range(4) for run in ("big", "small")]
    assert all(len(shared_pass) == 1 for shared_pass in recorder.passes)


def test_runs_left_out_by_the_token_budget_go_first_in_the_next_pass():
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared, max_tokens_per_pass=100)
    for step in range(2):
        for run, tokens in (("a", 60), ("b", 60), ("c", 30)):
            scheduler.submit(shared_job(run, step, tokens=tokens))
    gate.set()
    drain(scheduler, "abc")
    assert recorder.passes == [["a:0", "c:0"], ["b:0", "c:1"], ["a:1"], ["b:1"]]


def test_zero_token_budget_trains_one_request_per_pass_without_waiting():
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared, max_tokens_per_pass=0, cycle_wait_s=5.0)
    for step in range(2):
        for run in ("a", "b"):
            scheduler.submit(shared_job(run, step))
    started = time.monotonic()
    gate.set()
    drain(scheduler, "ab")
    assert recorder.passes == [["a:0"], ["b:0"], ["a:1"], ["b:1"]]
    assert time.monotonic() - started < 2.0


def test_other_calls_keep_their_place_in_the_runs_queue():
    recorder, events = Recorder(), []
    scheduler, gate = blocked_scheduler(recorder.run_shared)
    scheduler.submit(shared_job("a", 0))
    scheduler.submit(Job("a", lambda: events.append("a:step"), lambda result, error: None))
    scheduler.submit(shared_job("a", 1))
    scheduler.submit(shared_job("b", 0))
    gate.set()
    drain(scheduler, "ab")
    assert recorder.passes == [["a:0", "b:0"], ["a:1"]]
    assert events == ["a:step"]


def test_a_stream_of_training_calls_does_not_hold_back_other_runs_calls():
    """Each cycle runs the other calls queued after its pass: b's call waits for one pass, not five."""
    events: list[str] = []

    def run_shared(requests: list[Request]) -> list[SimpleNamespace]:
        events.extend(f"{request.run}:{request.step}" for request in requests)
        return [SimpleNamespace(output=None, error=None) for _ in requests]

    scheduler, gate = blocked_scheduler(run_shared)
    for step in range(5):
        scheduler.submit(shared_job("a", step))
    scheduler.submit(Job("b", lambda: events.append("b:save"), lambda result, error: None))
    gate.set()
    drain(scheduler, "ab")
    assert events == ["a:0", "b:save", "a:1", "a:2", "a:3", "a:4"]


def test_results_and_errors_reach_their_own_job():
    def run_shared(requests: list[Request]) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(output=None, error=ValueError("bad"))
            if r.run == "bad"
            else SimpleNamespace(output=r.step * 2, error=None)
            for r in requests
        ]

    scheduler, gate = blocked_scheduler(run_shared)
    outcomes = {}

    def record(run):
        return lambda result, error: outcomes.__setitem__(run, (result, error))

    for run in ("good", "bad"):
        scheduler.submit(shared_job(run, 21, on_done=record(run)))
    gate.set()
    drain(scheduler, ["good", "bad"])
    assert outcomes["good"] == (42, None)
    assert isinstance(outcomes["bad"][1], ValueError)


def test_a_failed_pass_fails_every_job_in_it_and_the_next_pass_runs():
    recorder, errors = Recorder(), []

    def run_shared(requests: list[Request]) -> list[SimpleNamespace]:
        if requests[0].step == 0:
            raise RuntimeError("out of memory")
        return recorder.run_shared(requests)

    scheduler, gate = blocked_scheduler(run_shared)
    for run in ("a", "b"):
        scheduler.submit(shared_job(run, 0, on_done=lambda result, error: errors.append(str(error))))
        scheduler.submit(shared_job(run, 1))
    gate.set()
    drain(scheduler, "ab")
    assert errors == ["out of memory", "out of memory"]
    assert recorder.passes == [["a:1", "b:1"]]


def test_stopping_fails_what_is_still_queued():
    recorder = Recorder()
    scheduler, gate = blocked_scheduler(recorder.run_shared)
    errors = []
    scheduler.submit(Job("a", lambda: None, lambda result, error: errors.append(error)))
    threading.Timer(0.2, gate.set).start()
    scheduler.stop()
    assert len(errors) == 1 and "shut down" in str(errors[0])


def test_stopping_ends_a_pass_waiting_for_tenants_at_once():
    recorder, errors = Recorder(), []
    scheduler, gate = blocked_scheduler(recorder.run_shared, cycle_wait_s=30.0)
    for run in ("a", "b"):
        scheduler.submit(shared_job(run, 0))
    gate.set()
    scheduler.call("a", lambda: None, timeout=30)  # after the pass of a and b
    scheduler.submit(shared_job("a", 1, on_done=lambda result, error: errors.append(error)))  # waits for b
    started = time.monotonic()
    scheduler.stop()
    assert time.monotonic() - started < 5.0
    assert recorder.passes == [["a:0", "b:0"]]
    assert len(errors) == 1 and "shut down" in str(errors[0])


def test_negative_options_are_refused():
    with pytest.raises(ValueError, match="cycle_wait_s must be >= 0"):
        Scheduler(Recorder().run_shared, cycle_wait_s=-1)
