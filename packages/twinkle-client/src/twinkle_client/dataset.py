"""``Dataset`` over HTTP: the in-process pipeline, recorded here and built by the server.

``set_template``/``map``/``encode``/``filter``/``shuffle``/``select`` are recorded
as steps; the server loads and processes the data on first use (``len``, a
``DataLoader``), and again if steps are added afterwards. Components travel by
name (see :mod:`twinkle_client.components`): ``{"name": ..., "kwargs": {...}}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle_client.components import merged_spec
from twinkle_client.context import get_client

Source = int | str | None  # which added dataset a step applies to, as in-process (a remote dataset has one)


@dataclass
class DatasetMeta:
    """A dataset the server can load: ``builtin://``, ``hf://``, ``ms://`` ids or a path on the server.

    ``data`` (in-memory rows) exists for signature parity with the in-process class and is refused:
    rows stay on this machine.
    """

    dataset_id: str = ""
    subset_name: str | None = None
    split: str = "train"
    data_slice: slice | range | Sequence[int] | None = None
    data: Any = None

    def __post_init__(self) -> None:
        if self.data is not None:
            raise ConfigurationError(
                "DatasetMeta(data=...) holds rows in this process, which the server cannot read; "
                "pass a dataset_id the server can load (builtin://, hf://, ms:// or a path on the server)"
            )
        if not isinstance(self.dataset_id, str) or not self.dataset_id:
            raise ConfigurationError(f"DatasetMeta.dataset_id must be a non-empty string, got {self.dataset_id!r}")

    @property
    def name(self) -> str:
        """How logs and errors refer to this source."""
        return self.dataset_id

    def to_dict(self) -> dict[str, Any]:
        """The source fields of ``POST /datasets``; a slice or range travels as ``{"start", "stop", "step"}``."""
        body: dict[str, Any] = {"dataset_id": self.dataset_id, "split": self.split}
        if self.subset_name is not None:
            body["subset_name"] = self.subset_name
        if isinstance(self.data_slice, (slice, range)):
            body["data_slice"] = {
                "start": self.data_slice.start,
                "stop": self.data_slice.stop,
                "step": self.data_slice.step,
            }
        elif self.data_slice is not None:
            body["data_slice"] = list(self.data_slice)
        return body


class Dataset:
    """Remote twin of ``twinkle.dataset.Dataset`` (one source; load options belong to the server)."""

    def __init__(self, dataset_meta: DatasetMeta | str, **ignored_load_options: Any) -> None:
        self.meta = DatasetMeta(dataset_meta) if isinstance(dataset_meta, str) else dataset_meta
        if not isinstance(self.meta, DatasetMeta):
            raise InvalidInputError(f"Dataset needs a DatasetMeta or a dataset id, got {type(dataset_meta).__name__}")
        self.steps: list[dict[str, Any]] = []
        self._created: dict[str, Any] | None = None

    def set_template(self, template: Any, **kwargs: Any) -> None:
        name, built = merged_spec(template, kwargs, "set_template(template)")
        self._record("set_template", template={"name": name, "kwargs": built})

    def map(
        self, preprocessor: Any, *, source: Source = None, strict: bool = True, batched: bool = True, **map_kwargs: Any
    ) -> None:
        """``preprocessor``: a registered name, a registered class or an instance of one (not a lambda)."""
        options = _changed(source=(source, None), strict=(strict, True), batched=(batched, True))
        self._record("map", preprocessor=_spec(preprocessor, "map(preprocessor)"), **options, **map_kwargs)

    def encode(
        self,
        add_generation_prompt: bool = False,
        batched: bool = True,
        *,
        source: Source = None,
        strict: bool = True,
        drop_unsupervised: bool = False,
        **map_kwargs: Any,
    ) -> None:
        if not any(step["op"] == "set_template" for step in self.steps):
            raise ConfigurationError("encode() needs a template: call set_template(...) first")
        options = _changed(
            batched=(batched, True),
            source=(source, None),
            strict=(strict, True),
            drop_unsupervised=(drop_unsupervised, False),
        )
        self._record("encode", add_generation_prompt=add_generation_prompt, **options, **map_kwargs)

    def filter(self, predicate: Any, *, source: Source = None, batched: bool = True, **map_kwargs: Any) -> None:
        """``predicate``: a registered name or a module-level function registered on the server."""
        options = _changed(source=(source, None), batched=(batched, True))
        self._record("filter", predicate=_spec(predicate, "filter(predicate)"), **options, **map_kwargs)

    def shuffle(self, seed: int = 42, *, source: Source = None) -> None:
        self._record("shuffle", seed=seed, **_changed(source=(source, None)))

    def select(self, indices: Sequence[int]) -> None:
        self._record("select", indices=list(indices))

    @property
    def handle(self) -> str:
        """The server's dataset (built from the recorded steps on first use)."""
        return self._create()["handle"]

    def __len__(self) -> int:
        return self._create()["length"]

    def _create(self) -> dict[str, Any]:
        if self._created is None:
            body = {**self.meta.to_dict(), "steps": self.steps}
            self._created = get_client().request("POST", "/datasets", body)
        return self._created

    def _record(self, op: str, **kwargs: Any) -> None:
        self.steps.append({"op": op, "kwargs": kwargs})
        self._created = None  # the server's copy no longer has every step

    def __repr__(self) -> str:
        return f"Dataset({self.meta.dataset_id!r}, steps={[step['op'] for step in self.steps]})"


def _changed(**options: tuple[Any, Any]) -> dict[str, Any]:
    """The ``{name: (value, in-process default)}`` options whose value differs: the server applies the defaults."""
    return {name: value for name, (value, default) in options.items() if value != default}


def _spec(component: Any, where: str) -> dict[str, Any]:
    name, kwargs = merged_spec(component, {}, where)
    return {"name": name, "kwargs": kwargs}
