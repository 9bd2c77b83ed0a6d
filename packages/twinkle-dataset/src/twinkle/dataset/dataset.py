"""``Dataset``: load rows, preprocess them into trajectories, encode them, and serve them by index."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import datasets

from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.mixing import MixStrategy, mix_datasets
from twinkle.dataset.row_map import MapResult, RowFunction, hf_map_options, map_rows
from twinkle.dataset.sources import load_source
from twinkle.dataset.steps import TOKEN_FEATURES, encode_row, keep_rows, preprocess_row
from twinkle.dataset.supervision import check_supervision
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.infra import remote_class
from twinkle.registry import build, register
from twinkle.utils import get_logger

logger = get_logger(__name__)

Source = int | str | None


@dataclass
class _Part:
    """One added dataset, kept apart until :meth:`Dataset.mix` so each can get its own preprocessor."""

    name: str
    data: datasets.Dataset
    preprocessors: list[str] = field(default_factory=list)  # the map steps so far, named in encode's messages


@register("dataset")
@remote_class
class Dataset:
    """Training rows backed by Hugging Face ``datasets`` (Arrow, memory-mapped, cached by fingerprint).

    Typical use::

        dataset = Dataset(DatasetMeta("builtin://self-cognition", data_slice=range(500)))
        dataset.set_template("Template", model_id="builtin://qwen3-tiny", max_length=2048)
        dataset.map(SelfCognitionProcessor("Twinkle", "ModelScope"))
        dataset.encode()
        dataset[0]  # an InputFeature dict

    Methods change the dataset in place and return ``None``: the object may
    be a remote proxy (``@remote_class``), where returning ``self`` would copy
    the rows back. ``load_kwargs`` (``cache_dir``, ``num_proc``, ...) go to
    ``datasets.load_dataset`` for every file-backed source.

    Several sources can be added (:meth:`add_dataset`): ``map``/``filter``/
    ``encode``/``shuffle`` apply to each (or to one chosen with ``source=``, an
    index or a dataset id) and :meth:`mix` combines them; reading rows needs a
    single, mixed dataset.
    """

    def __init__(self, dataset_meta: DatasetMeta | str, **load_kwargs: Any) -> None:
        self._load_kwargs = load_kwargs
        self._parts: list[_Part] = []
        self._template: Any = None
        self.add_dataset(dataset_meta)

    # ----- sources -----------------------------------------------------------------------------

    def add_dataset(self, dataset: DatasetMeta | str | Dataset) -> None:
        """Add another source (a meta, a dataset id, or another Dataset's sources) to :meth:`mix` later."""
        if isinstance(dataset, Dataset):
            self._parts.extend(dataset._parts)
            return
        meta = DatasetMeta(dataset) if isinstance(dataset, str) else dataset
        if not isinstance(meta, DatasetMeta):
            raise ConfigurationError(f"expected a DatasetMeta, a dataset id or a Dataset, got {type(dataset).__name__}")
        data = load_source(meta, self._load_kwargs)
        self._parts.append(_Part(meta.name, data))
        logger.info("loaded %s: %d rows, columns %s", meta.name, len(data), data.column_names)

    def mix(
        self,
        strategy: MixStrategy = "concat",
        probabilities: Sequence[float] | None = None,
        seed: int = 42,
        stopping_strategy: str = "first_exhausted",
    ) -> None:
        """Combine the added datasets into one (see :func:`twinkle.dataset.mixing.mix_datasets`)."""
        names = [part.name for part in self._parts]
        data = mix_datasets(
            [part.data for part in self._parts], names, strategy, probabilities, seed, stopping_strategy
        )
        preprocessors = [step for part in self._parts for step in part.preprocessors]
        self._parts = [_Part(f"{strategy}({', '.join(names)})", data, list(dict.fromkeys(preprocessors)))]
        logger.info("mixed %d datasets with %s: %d rows", len(names), strategy, len(data))

    # ----- processing --------------------------------------------------------------------------

    def set_template(self, template: Any, **kwargs: Any) -> None:
        """Set the template :meth:`encode` uses: an instance, a class, or a registered name plus its arguments."""
        self._template = build("template", template, **kwargs)

    @property
    def template(self) -> Any:
        return self._template

    def map(
        self, preprocessor: Any, *, source: Source = None, strict: bool = True, batched: bool = True, **map_kwargs: Any
    ) -> None:
        """Turn every row into a new one (usually a trajectory) with ``preprocessor``.

        ``preprocessor`` is a Preprocessor instance, class or registered name, or
        any function ``row -> row | None``. ``None`` drops a row on purpose. A row
        it rejects with :class:`~twinkle.errors.InvalidInputError` is reported
        after the pass: :class:`~twinkle.dataset.DataProcessingError` lists them,
        or with ``strict=False`` they are dropped and counted in a warning.
        ``map_kwargs``: ``num_proc``, ``batch_size``, ``load_from_cache_file``, ...
        """
        function = build("preprocessor", preprocessor)
        step = f"map({_name(function)})"
        for part, result in self._map_parts(
            partial(preprocess_row, function), step, source, strict, batched, map_kwargs
        ):
            part.preprocessors.append(step)
            dropped = f" ({result.num_dropped} dropped by the preprocessor)" if result.num_dropped else ""
            logger.info("%s on %s: %d -> %d rows%s", step, part.name, result.num_input, len(result.data), dropped)

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
        """Encode every trajectory into an InputFeature with the template from :meth:`set_template`.

        ``add_generation_prompt=True`` encodes prompts for sampling (RL) instead
        of labelled conversations. Rows the template deletes (``None``, e.g.
        too long under ``truncation_strategy='delete'``) are counted in a log line.
        Labelled rows with no supervised token (no assistant answer, or one that
        truncation cut off) train nothing: a warning counts them, and
        ``drop_unsupervised=True`` drops them; a dataset with no supervised row
        at all raises ConfigurationError (e.g. a prompt-only preprocessor).
        """
        if self._template is None:
            raise ConfigurationError("encode() needs a template: call set_template(...) first")
        row_fn = partial(encode_row, self._template, add_generation_prompt)

        def review(part: _Part, data: datasets.Dataset) -> datasets.Dataset:
            if add_generation_prompt:  # prompts for sampling supervise nothing by design
                return data
            return check_supervision(data, part.name, part.preprocessors, self._template, drop_unsupervised)

        results = self._map_parts(row_fn, "encode", source, strict, batched, map_kwargs, TOKEN_FEATURES, review)
        for part, result in results:
            logger.info("encode on %s: %d -> %d rows", part.name, result.num_input, len(result.data))
            if result.num_dropped:
                logger.info(
                    "encode on %s: the template deleted %d rows (max_length=%s, truncation_strategy=%r)",
                    part.name,
                    result.num_dropped,
                    getattr(self._template, "max_length", None),
                    getattr(self._template, "truncation_strategy", None),
                )

    def filter(
        self,
        predicate: Callable[[dict[str, Any]], Any],
        *,
        source: Source = None,
        batched: bool = True,
        **map_kwargs: Any,
    ) -> None:
        """Keep the rows for which ``predicate(row)`` is true (it always sees one row)."""
        options = hf_map_options(map_kwargs, batched)
        function = build("preprocessor", predicate)
        parts = self._select_parts(source)
        kept = [
            part.data.filter(keep_rows, batched=True, with_indices=True, fn_kwargs={"predicate": function}, **options)
            for part in parts
        ]
        for part, data in zip(parts, kept, strict=True):
            logger.info("filter(%s) on %s: %d -> %d rows", _name(function), part.name, len(part.data), len(data))
            part.data = data

    def shuffle(self, seed: int = 42, *, source: Source = None) -> None:
        """Shuffle the row order reproducibly (an index permutation; no rows are copied)."""
        for part in self._select_parts(source):
            part.data = part.data.shuffle(seed=seed)

    def select(self, indices: Sequence[int]) -> None:
        """Keep only the rows at ``indices``, in that order."""
        part = self._single()
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(part.data)]
        if bad:
            raise InvalidInputError(f"select: indices outside [0, {len(part.data)}) of {part.name}: {bad[:10]}")
        part.data = part.data.select(indices)

    # ----- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._single().data)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One row as a plain dict (an InputFeature after :meth:`encode`)."""
        data = self._single().data
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidInputError(f"a Dataset is indexed by int, got {type(index).__name__}")
        if not -len(data) <= index < len(data):
            raise IndexError(f"row {index} is out of range for a dataset of {len(data)} rows")
        row: dict[str, Any] = data[index]
        return row

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Several rows in one Arrow read; data loaders use it to fetch a batch."""
        rows: list[dict[str, Any]] = self._single().data.__getitems__(list(indices))
        return rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._single().data)

    @property
    def column_names(self) -> list[str]:
        names: list[str] = self._single().data.column_names
        return names

    def to_hf(self) -> datasets.Dataset:
        """The underlying ``datasets.Dataset`` (nested columns are ``datasets.Json``)."""
        return self._single().data

    def __repr__(self) -> str:
        parts = ", ".join(f"{part.name!r}: {len(part.data)} rows {part.data.column_names}" for part in self._parts)
        return f"Dataset({parts})"

    # ----- helpers -----------------------------------------------------------------------------

    def _map_parts(
        self,
        row_fn: RowFunction,
        step: str,
        source: Source,
        strict: bool,
        batched: bool,
        map_kwargs: Mapping[str, Any],
        native_features: Mapping[str, Any] | None = None,
        review: Callable[[_Part, datasets.Dataset], datasets.Dataset] | None = None,
    ) -> list[tuple[_Part, MapResult]]:
        """Map every selected part; ``review`` may raise, or return the mapped rows to keep. Parts change only
        once all succeeded, so a failed call can be retried."""
        extra = {"native_features": native_features, "options": hf_map_options(map_kwargs, batched)}
        results = [
            (part, map_rows(part.data, row_fn, f"{step} on {part.name}", strict=strict, **extra))
            for part in self._select_parts(source)
        ]
        kept = [result.data if review is None else review(part, result.data) for part, result in results]
        for (part, _), data in zip(results, kept, strict=True):
            part.data = data
        return results

    def _select_parts(self, source: Source) -> list[_Part]:
        if source is None:
            return self._parts
        if isinstance(source, int) and not isinstance(source, bool) and 0 <= source < len(self._parts):
            return [self._parts[source]]
        named = [part for part in self._parts if part.name == source]
        if not named:
            available = [f"{i}: {part.name}" for i, part in enumerate(self._parts)]
            raise ConfigurationError(f"no added dataset {source!r}; available: {available}")
        return named

    def _single(self) -> _Part:
        if len(self._parts) > 1:
            names = [part.name for part in self._parts]
            raise ConfigurationError(
                f"this Dataset holds {len(names)} datasets {names}; call mix() to combine them first"
            )
        return self._parts[0]


def _name(function: Any) -> str:
    return getattr(function, "__name__", None) or type(function).__name__
