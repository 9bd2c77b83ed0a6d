"""Server-side datasets and dataloaders, used by handle, so big data never passes through the client.

Tenants build a dataset from a hub id (never a server path) and a list of
steps (``set_template``, ``map``, ``encode``, ``filter``, ``shuffle``,
``select``) whose components are registered names; a dataloader over it then
hands out one batch of encoded features per request.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import InvalidInputError, PermissionDeniedError, ResourceNotFoundError
from twinkle.registry import build
from twinkle.server.services.components import check_component_name

ALLOWED_SCHEMES = ("builtin://", "hf://", "ms://")
_STEPS = ("set_template", "map", "encode", "shuffle", "select")


@dataclass
class _Loader:
    user: str
    loader: DataLoader
    batches: Iterator[Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class DataHandles:
    """Datasets and dataloaders by handle, each owned by the user who created it."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self._datasets: dict[str, tuple[str, Dataset]] = {}
        self._loaders: dict[str, _Loader] = {}
        self._lock = threading.Lock()

    def create_dataset(self, user: str, dataset_id: Any, split: Any, steps: Any) -> tuple[str, int]:
        if not isinstance(dataset_id, str) or not dataset_id.startswith(ALLOWED_SCHEMES):
            raise PermissionDeniedError(
                f"dataset_id must be a hub id starting with one of {ALLOWED_SCHEMES}, got {dataset_id!r}; "
                "server paths are not readable by tenants"
            )
        if not isinstance(steps, Sequence) or isinstance(steps, (str, bytes)):
            raise InvalidInputError(f"steps must be a list of {{'op', 'kwargs'}} objects, got {type(steps).__name__}")
        dataset = Dataset(DatasetMeta(dataset_id, split=split or "train"))
        for index, step in enumerate(steps):
            self._apply(dataset, step, index)
        handle = f"ds-{secrets.token_urlsafe(12)}"
        with self._lock:
            self._datasets[handle] = (user, dataset)
        return handle, len(dataset)

    def create_dataloader(self, user: str, dataset: str, batch_size: Any, shuffle: Any, seed: Any) -> tuple[str, int]:
        source = self._owned(self._datasets, dataset, user, "dataset")[1]
        loader = DataLoader(dataset=source, batch_size=batch_size, shuffle=bool(shuffle), seed=seed)
        handle = f"dl-{secrets.token_urlsafe(12)}"
        with self._lock:
            self._loaders[handle] = _Loader(user, loader)
        return handle, len(loader)

    def next_batch(self, user: str, handle: str) -> list[Any] | None:
        """The next batch, or ``None`` at the end of the epoch (the next call starts a new one)."""
        entry = self._owned(self._loaders, handle, user, "dataloader")
        with entry.lock:
            if entry.batches is None:
                entry.batches = iter(entry.loader)
            batch = next(entry.batches, None)
            if batch is None:
                entry.batches = None
            return batch

    def reset(self, user: str, handle: str) -> None:
        entry = self._owned(self._loaders, handle, user, "dataloader")
        with entry.lock:
            entry.batches = None

    def drop_user(self, user: str) -> None:
        with self._lock:
            for table in (self._datasets, self._loaders):
                for handle in [h for h, entry in table.items() if _owner(entry) == user]:
                    del table[handle]

    def _apply(self, dataset: Dataset, step: Any, index: int) -> None:
        if not isinstance(step, Mapping) or step.get("op") not in _STEPS:
            raise InvalidInputError(f"steps[{index}] must be {{'op': one of {list(_STEPS)}, 'kwargs': {{...}}}}")
        op, kwargs = step["op"], dict(step.get("kwargs") or {})
        if op == "set_template":
            check_component_name(kwargs.get("template", "Template"), f"steps[{index}] template")
            kwargs["model_id"] = self.model_id  # the server's own model, whatever the client says
            dataset.set_template(kwargs.pop("template", "Template"), **kwargs)
        elif op == "map":
            name = check_component_name(kwargs.pop("name", None), f"steps[{index}].kwargs.name")
            component = build("preprocessor", name, **kwargs.pop("init", {}))
            dataset.map(component, **kwargs)
        else:
            getattr(dataset, op)(**kwargs)

    def _owned(self, table: dict[str, Any], handle: str, user: str, what: str) -> Any:
        with self._lock:
            entry = table.get(handle)
        if entry is None or _owner(entry) != user:
            raise ResourceNotFoundError(f"no {what} {handle!r}")
        return entry


def _owner(entry: Any) -> str:
    return entry[0] if isinstance(entry, tuple) else entry.user
