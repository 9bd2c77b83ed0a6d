"""Recording a new run: the one implementation under both APIs (quota first, then an open session's run)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.server.quotas import QuotaChecker
from twinkle.server.store import Store
from twinkle.server.store.base import Run


def record_run(
    store: Store,
    quotas: QuotaChecker,
    user: str,
    session_id: str,
    lora_config: Mapping[str, Any] | None,
    gradient_accumulation_steps: int = 1,
    base_model: str | None = None,
    run_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Run:
    """A new resident run of ``user`` in open session ``session_id``, once the user's adapter quota allows it.

    ``lora_config`` ``None`` is a full-parameter run. Loading its weights is the caller's (now, or as a future).
    """
    quotas.check_new_adapter(user, store.count_resident_runs(user), largest_rank(lora_config))
    config = None if lora_config is None else dict(lora_config)
    run = store.create_run(
        user, session_id, config, gradient_accumulation_steps, base_model, run_id=run_id, metadata=metadata
    )
    if run is None:
        raise ResourceNotFoundError(f"no open session {session_id!r}; open a session first")
    return run


def largest_rank(lora_config: Mapping[str, Any] | None) -> int:
    """The largest LoRA rank the config asks for (``rank_pattern`` included); 0 for a full-parameter run."""
    if lora_config is None:
        return 0
    ranks = [lora_config.get("r", 8), *dict(lora_config.get("rank_pattern") or {}).values()]
    if not all(isinstance(rank, int) and not isinstance(rank, bool) for rank in ranks):
        raise InvalidInputError(f"LoRA ranks must be integers, got r={lora_config.get('r')!r}")
    return max(ranks)
