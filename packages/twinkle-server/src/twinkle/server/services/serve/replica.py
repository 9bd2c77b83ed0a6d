"""The model deployment: each Serve replica holds the base model and the adapters of the runs placed on it.

Every method takes the replica it is addressed to first (``PinnedReplicaRouter``
routes on it). Pool calls run one at a time on a worker thread, so the
replica's event loop stays free for ``info`` and Serve's health checks while a
long forward-backward runs.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ray import serve

from twinkle.model import AdapterResult
from twinkle.sampler import SampleResult
from twinkle.server.services.batches import SharedRequest
from twinkle.server.services.engine import Task
from twinkle.server.services.pool import ModelPool


class ModelReplica:
    def __init__(
        self,
        model_id: str,
        max_loras: int,
        max_rank: int,
        device: str | None = None,
        model_options: dict[str, Any] | None = None,
    ) -> None:
        _serve_internal_grpc_on_loopback()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.pool = ModelPool(model_id, max_loras, max_rank, device, model_options)
        self._lock = threading.Lock()

    async def info(self, replica_id: str | None) -> dict[str, Any]:
        pool = self.pool
        return {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "max_length": pool.max_length,
            "vocab_size": pool.model.vocab_size,
            "model_path": pool.model_path,
            "model_type": pool.model.model.config.model_type,
            "routing": pool.routing,
            "adapters": sorted(pool.model.adapter_names),
        }

    async def apply(self, replica_id: str, task: Task) -> Any:
        return await self._run(replica_id, task.apply, self.pool)

    async def run_batch(
        self, replica_id: str, requests: Sequence[SharedRequest]
    ) -> list[AdapterResult] | list[SampleResult]:
        return await self._run(replica_id, self.pool.run_batch, requests)

    async def _run(self, replica_id: str, fn: Any, *args: Any) -> Any:
        if replica_id != self.replica_id:  # the router's contract, checked where the state lives
            raise RuntimeError(f"a call for replica {replica_id} reached replica {self.replica_id}")
        return await asyncio.to_thread(self._locked, fn, *args)

    def _locked(self, fn: Any, *args: Any) -> Any:
        with self._lock:
            return fn(*args)


def _serve_internal_grpc_on_loopback() -> None:
    """Serve's replica starts an inter-deployment gRPC server on ``[::]:0`` (Ray 2.60, no option):
    bind it to 127.0.0.1, as every other socket here, before Serve starts it (after this constructor)."""
    from ray.serve._private import replica as serve_replica

    add_port: Callable[[Any, str], int] = serve_replica.add_port_to_grpc_server
    if getattr(add_port, "twinkle_loopback", False):
        return

    def add_port_on_loopback(server: Any, address: str) -> int:
        return add_port(server, address.replace("[::]:", "127.0.0.1:"))

    add_port_on_loopback.twinkle_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port_on_loopback
