"""What the OpenAI API keeps beside the server's state: which replicas' samplers hold which checkpoints."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from twinkle.server.app.state import ServerState
from twinkle.server.services.engine import PoolTask
from twinkle.server.services.futures import api_method
from twinkle.utils import get_logger

logger = get_logger(__name__)


class OpenAIState:
    """Checkpoint adapters loaded into samplers, so that a removed checkpoint leaves every sampler holding it."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._replicas: defaultdict[str, set[int]] = defaultdict(set)  # adapter -> replicas that loaded it
        self._lock = threading.Lock()

    def loaded(self, adapter: str, replica: int) -> None:
        with self._lock:
            self._replicas[adapter].add(replica)

    def checkpoint_removed(self, user: str, run_id: str, name: str) -> None:
        """Drop the checkpoint's adapters (any saved under this name) from the samplers that loaded them."""
        prefix = f"openai:{user}:{run_id}/{name}@"
        with self._lock:
            names = [adapter for adapter in self._replicas if adapter.startswith(prefix)]
            dropped = {adapter: self._replicas.pop(adapter) for adapter in names}
        for adapter, replicas in dropped.items():
            for replica in replicas:
                task = PoolTask("drop_sampler_adapter", (adapter,))
                labels = (user, api_method("openai", "drop_sampler_adapter"))
                self._state.engine.submit(f"openai:{user}", task, _log_failure(adapter), None, 0, labels, replica)


def _log_failure(adapter: str) -> Any:
    def on_done(_: Any, error: BaseException | None) -> None:
        if error is not None:
            logger.warning("could not drop sampler adapter %s: %s", adapter, error)

    return on_done
