"""Prometheus metrics: per tenant (calls, tokens, queue wait, step latency) and for the server (pool, queue)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from twinkle.server.services.batches import SAMPLE, batch_kind
from twinkle.server.services.futures import api_of

if TYPE_CHECKING:
    from twinkle.server.services.engine import Engine
    from twinkle.server.services.scheduler import Job

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Telemetry:
    """One registry per server (not the global one), so several servers in one process do not clash."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter(
            "twinkle_calls", "Calls run, by tenant and method", ["user", "method"], registry=self.registry
        )
        self.tokens = Counter("twinkle_tokens", "Input tokens trained on, by tenant", ["user"], registry=self.registry)
        self.queue_wait = Histogram(
            "twinkle_queue_wait_seconds",
            "Time a call waited in the scheduler",
            ["user"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.latency = Histogram(
            "twinkle_step_latency_seconds",
            "Time to run a call (a shared pass counts for each tenant in it)",
            ["user", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.pool_used = Gauge("twinkle_pool_adapters", "Adapters resident in the pool", registry=self.registry)
        self.pool_size = Gauge("twinkle_pool_capacity", "Adapter slots in the pool", registry=self.registry)
        self.pass_requests = Histogram(
            "twinkle_shared_pass_requests",
            "Tenants' requests trained together in one shared pass",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=self.registry,
        )
        self.shared_calls = Counter(
            "twinkle_shared_pass_calls",
            "Calls trained in a shared pass together with other tenants' calls, by API",
            ["api"],
            registry=self.registry,
        )
        self.sample_batch_requests = Histogram(
            "twinkle_sample_batch_requests",
            "Sample calls generated together in one batch",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.queue_depth = Gauge("twinkle_queue_depth", "Calls waiting in the scheduler", registry=self.registry)
        # Grows only; its rate is the model's utilisation (1: never waiting for tenants' calls).
        self.busy = Gauge(
            "twinkle_model_busy_seconds",
            "Seconds the model spent running calls since start (replicas summed; a shared pass counted once)",
            registry=self.registry,
        )

    def bind_engine(self, engine: Engine) -> None:
        self.pool_used.set_function(lambda: engine.resident_count)
        self.pool_size.set(engine.max_loras)
        self.queue_depth.set_function(engine.queue_depth)
        self.busy.set_function(engine.busy_seconds)

    def observe_job(self, event: str, job: Job, seconds: float) -> None:
        user, method = job.labels
        if event == "start":
            self.queue_wait.labels(user).observe(seconds)
        else:
            self.calls.labels(user, method).inc()
            self.latency.labels(user, method).observe(seconds)
            if job.tokens and batch_kind(job.shared) != SAMPLE:  # a sample call's are the slots it may fill
                self.tokens.labels(user).inc(job.tokens)

    def observe_pass(self, jobs: list[Job]) -> None:
        """A batch the scheduler ran: a shared pass, or sample calls generated together."""
        if batch_kind(jobs[0].shared) == SAMPLE:
            self.sample_batch_requests.observe(len(jobs))
            return
        self.pass_requests.observe(len(jobs))
        if len(jobs) > 1:
            for job in jobs:
                self.shared_calls.labels(api_of(job.labels[1]) or "twinkle").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"
