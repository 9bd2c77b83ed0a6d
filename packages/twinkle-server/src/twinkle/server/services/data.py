"""Server-side datasets and dataloaders, used by handle, so big data never passes through the client.

Tenants build a dataset from a hub id (never a server path) and a list of
steps (``set_template``, ``map``, ``encode``, ``filter``, ``shuffle``,
``select``) whose components are registered names; a dataloader over it then
hands out one batch of encoded features per request. Request bodies arrive
typed (``app.schemas.misc``).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.errors import InvalidInputError, PermissionDeniedError, ResourceNotFoundError
from twinkle.registry import build
from twinkle.server.services.components import check_component_name

ALLOWED_SCHEMES = ("builtin://", "hf://", "ms://")
# Step arguments that name a component, and the registry kind each is built from.
_COMPONENT_ARGUMENTS = {"template": "template", "preprocessor": "preprocessor", "predicate": "preprocessor"}


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

    def create_dataset(self, user: str, body: Mapping[str, Any]) -> tuple[str, int]:
        """A dataset from ``{"dataset_id", "split", "subset_name", "data_slice", "steps"}`` (see the module doc)."""
        dataset_id, steps = body.get("dataset_id"), body.get("steps", [])
        if not isinstance(dataset_id, str) or not dataset_id.startswith(ALLOWED_SCHEMES):
            raise PermissionDeniedError(
                f"dataset_id must be a hub id starting with one of {ALLOWED_SCHEMES}, got {dataset_id!r}; "
                "server paths are not readable by tenants"
            )
        meta = DatasetMeta(
            dataset_id,
            subset_name=body.get("subset_name"),
            split=body.get("split") or "train",
            data_slice=_data_slice(body.get("data_slice")),
        )
        dataset = Dataset(meta)
        for index, step in enumerate(steps):
            self._apply(dataset, step, index)
        handle = f"ds-{secrets.token_urlsafe(12)}"
        with self._lock:
            self._datasets[handle] = (user, dataset)
        return handle, len(dataset)

    def create_dataloader(self, user: str, body: Mapping[str, Any]) -> tuple[str, int]:
        """A dataloader from ``{"dataset": handle, "batch_size", "shuffle", "seed", "min_batch_size", "drop_last"}``."""
        source = self._owned(self._datasets, body.get("dataset"), user, "dataset")[1]
        loader = DataLoader(
            dataset=source,
            batch_size=body.get("batch_size"),  # type: ignore[arg-type]  # DataLoader validates the request's value
            min_batch_size=body.get("min_batch_size"),
            shuffle=bool(body.get("shuffle", False)),
            seed=body.get("seed", 42),
            drop_last=bool(body.get("drop_last", False)),
        )
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

    def _apply(self, dataset: Dataset, step: Mapping[str, Any], index: int) -> None:
        """``step`` is ``{"op": <one of the steps>, "kwargs": {...}}`` (checked at the HTTP edge)."""
        op, kwargs = step["op"], dict(step.get("kwargs") or {})
        for argument, kind in _COMPONENT_ARGUMENTS.items():
            if argument in kwargs:
                kwargs[argument] = self._component(kind, kwargs[argument], f"steps[{index}].kwargs.{argument}")
        getattr(dataset, op)(**kwargs)

    def _component(self, kind: str, spec: Any, where: str) -> Any:
        """A registered component from ``{"name", "kwargs"}``; templates always use the server's own model."""
        if not isinstance(spec, Mapping):
            raise InvalidInputError(f"{where} must be {{'name': <registered name>, 'kwargs': {{...}}}}")
        name = check_component_name(spec.get("name"), f"{where}.name")
        kwargs = dict(spec.get("kwargs") or {})
        if kind == "template":
            kwargs["model_id"] = self.model_id
        return build(kind, name, **kwargs)

    def _owned(self, table: dict[str, Any], handle: object, user: str, what: str) -> Any:
        """The caller's entry of ``table`` under ``handle`` (from a request body: any JSON value)."""
        with self._lock:
            entry = table.get(handle) if isinstance(handle, str) else None
        if entry is None or _owner(entry) != user:
            raise ResourceNotFoundError(f"no {what} {handle!r}")
        return entry


def _data_slice(value: Any) -> Any:
    """``{"start", "stop", "step"}`` as a slice, a list of indices as it is."""
    if isinstance(value, Mapping):
        return slice(value.get("start"), value.get("stop"), value.get("step"))
    return value


def _owner(entry: Any) -> str:
    return entry[0] if isinstance(entry, tuple) else entry.user
