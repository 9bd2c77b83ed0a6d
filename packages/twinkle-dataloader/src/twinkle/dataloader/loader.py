"""``DataLoader``: global batches of dataset rows, sliced per rank, resumable exactly. Plain Python, no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from twinkle.dataloader.plan import BatchPlan, epoch_order
from twinkle.dataloader.sharding import slice_rank
from twinkle.dataloader.state import LoaderState
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.infra import DeviceMesh, get_runtime, remote_class
from twinkle.interfaces import SizedDataset
from twinkle.registry import build, register
from twinkle.utils import get_logger

logger = get_logger(__name__)


@register("dataloader")
@remote_class
class DataLoader:
    """Iterate a dataset in batches of ``batch_size`` rows (the global batch), epoch after epoch.

    ``dataset`` is anything with ``__len__`` and ``__getitem__`` (a
    ``twinkle.dataset.Dataset``, a list), or a zero-argument callable that
    builds one — so a remote worker can build its dataset where it runs.

    Each ``for batch in loader`` runs through the rest of the current epoch;
    the next loop starts the next epoch, reshuffled from ``(seed, epoch)`` when
    ``shuffle``. A last batch shorter than ``batch_size`` is yielded when it has
    at least ``min_batch_size`` rows (default 1; ``drop_last`` means ``batch_size``).

    With a ``device_mesh`` the batch is split over its data-parallel ranks:
    under torchrun each card gets its slice (8 dp ranks, batch 16: rank ``r``
    gets rows ``[2r, 2r+2)``; tensor-parallel peers get the same slice); in a
    single process or on a Ray driver the loader yields all 16 and the
    infrastructure dispatches them (see :mod:`twinkle.dataloader.sharding`).
    ``rank`` picks the slice explicitly. A batch never has fewer rows than
    data-parallel ranks, so no rank is left without data. Without a
    ``device_mesh`` the loader uses ``twinkle.initialize(global_device_mesh=...)``'s.

    ``processor`` (an InputProcessor instance, class or registered name)
    collates each yielded list of rows, e.g. into padded tensors.
    ``remote_group`` (added by ``@remote_class``) names the device group the
    loader is placed on; under torchrun it maps the process rank into the mesh.
    """

    remote_group: str  # set by @remote_class before __init__ runs

    def __init__(
        self,
        dataset: SizedDataset | Callable[[], SizedDataset],
        batch_size: int,
        min_batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 42,
        drop_last: bool = False,
        device_mesh: DeviceMesh | None = None,
        processor: Any = None,
        rank: int | None = None,
    ) -> None:
        self.dataset = _build_dataset(dataset)
        num_samples = len(self.dataset)
        if num_samples == 0:
            raise InvalidInputError("DataLoader got an empty dataset")
        _check_positive_int("batch_size", batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigurationError(f"seed must be an int, got {seed!r}")
        self.batch_size = batch_size
        device_mesh = device_mesh or get_runtime().global_device_mesh
        self.min_batch_size = _min_batch_size(batch_size, min_batch_size, drop_last, device_mesh)
        self.device_mesh = device_mesh
        self.processor = None if processor is None else build("processor", processor)
        self._plan = BatchPlan(num_samples, batch_size, self.min_batch_size)
        if self._plan.num_batches == 0:
            raise InvalidInputError(
                f"a dataset of {num_samples} rows yields no batch of at least {self.min_batch_size} rows"
            )
        self._slice_rank = slice_rank(device_mesh, rank, self.remote_group)
        self._shuffle = bool(shuffle)
        self._seed = seed
        self._epoch = 0
        self._consumed = 0  # batches of the current epoch already yielded
        self._order: tuple[int, list[int]] | None = None  # (epoch, row order) of the last epoch used

    # ----- iteration ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._plan.num_batches

    def __iter__(self) -> Iterator[Any]:
        """Yield the remaining batches of the current epoch; a finished epoch rolls over to the next."""
        if self._consumed >= self._plan.num_batches:
            self._epoch, self._consumed = self._epoch + 1, 0
        while self._consumed < self._plan.num_batches:
            batch = self._load_batch(self._consumed)
            self._consumed += 1
            yield batch

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch (its order depends only on ``seed`` and ``epoch``)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidInputError(f"epoch must be a non-negative int, got {epoch!r}")
        self._epoch, self._consumed = epoch, 0

    # ----- checkpoints -------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """The position to save in a checkpoint: epoch, batches consumed in it, seed, and batching fingerprint."""
        return self._state().to_dict()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where the loader that produced ``state`` (via :meth:`get_state`) stopped."""
        if not isinstance(state, Mapping):
            raise InvalidInputError(f"DataLoader state must be a dict from get_state(), got {type(state).__name__}")
        saved = LoaderState.from_dict(dict(state))
        saved.check_fits(self._state())
        if saved.batches_consumed > self._plan.num_batches:
            raise InvalidInputError(
                f"DataLoader state: batches_consumed={saved.batches_consumed} exceeds the {self._plan.num_batches} "
                "batches of an epoch"
            )
        if saved.seed != self._seed:
            logger.info("DataLoader: resuming with the checkpoint's seed %d instead of %d", saved.seed, self._seed)
        self._seed, self._epoch, self._consumed = saved.seed, saved.epoch, saved.batches_consumed

    def resume_from_checkpoint(self, state: Mapping[str, Any] | int) -> None:
        """Resume from a :meth:`get_state` dict, or from a count of samples consumed since training began."""
        if isinstance(state, Mapping):
            self.load_state(state)
        elif isinstance(state, int) and not isinstance(state, bool):
            self.set_epoch(0)
            self.skip_consumed_samples(state)
        else:
            raise InvalidInputError(
                f"resume_from_checkpoint takes a get_state() dict or a number of samples, got {state!r}"
            )

    def skip_consumed_samples(self, num_samples: int) -> None:
        """Move forward ``num_samples`` rows (of global batches), possibly across epochs.

        The count must end on a batch boundary: half a batch cannot be resumed.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise InvalidInputError(f"num_samples must be a non-negative int, got {num_samples!r}")
        epoch, consumed, remaining = self._epoch, self._consumed, num_samples
        while remaining:
            if consumed == self._plan.num_batches:
                epoch, consumed = epoch + 1, 0
            size = self._plan.size_of(consumed)
            if size > remaining:
                raise InvalidInputError(
                    f"skipping {num_samples} samples stops inside a batch (batch_size={self.batch_size}, "
                    f"{self._plan.num_samples} rows per epoch); pass a count that ends on a batch boundary"
                )
            remaining -= size
            consumed += 1
        self._epoch, self._consumed = epoch, consumed

    # ----- helpers -----------------------------------------------------------------------------

    def _state(self) -> LoaderState:
        return LoaderState(
            epoch=self._epoch,
            batches_consumed=self._consumed,
            seed=self._seed,
            dataset_length=self._plan.num_samples,
            batch_size=self.batch_size,
            min_batch_size=self.min_batch_size,
            shuffle=self._shuffle,
        )

    def _load_batch(self, index: int) -> Any:
        indices = self._plan.batch(self._epoch_order(), index)
        if self._slice_rank is not None:
            indices = indices[self.device_mesh.get_slice(len(indices), self._slice_rank)]  # type: ignore[union-attr]
        rows = _fetch(self.dataset, indices)
        return rows if self.processor is None else self.processor(rows)

    def _epoch_order(self) -> list[int]:
        if self._order is None or self._order[0] != self._epoch:
            self._order = (self._epoch, epoch_order(self._plan.num_samples, self._shuffle, self._seed, self._epoch))
        return self._order[1]


def _build_dataset(dataset: Any) -> SizedDataset:
    if isinstance(dataset, type) or (callable(dataset) and not hasattr(dataset, "__len__")):
        dataset = dataset()
    if not isinstance(dataset, SizedDataset):
        raise ConfigurationError(
            f"DataLoader needs a dataset with __len__ and __getitem__ (or a callable building one), "
            f"got {type(dataset).__name__}"
        )
    return dataset


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")


def _min_batch_size(batch_size: int, min_batch_size: int | None, drop_last: bool, mesh: DeviceMesh | None) -> int:
    """The fewest rows a yielded batch may have, from the arguments and the number of data-parallel ranks."""
    if min_batch_size is not None:
        _check_positive_int("min_batch_size", min_batch_size)
        if min_batch_size > batch_size:
            raise ConfigurationError(f"min_batch_size={min_batch_size} exceeds batch_size={batch_size}")
        if drop_last and min_batch_size != batch_size:
            raise ConfigurationError(
                f"drop_last=True keeps only full batches; it contradicts min_batch_size={min_batch_size}"
            )
    smallest = batch_size if drop_last else (min_batch_size or 1)
    if mesh is not None:
        if batch_size < mesh.data_world_size:
            raise ConfigurationError(
                f"batch_size={batch_size} is smaller than the {mesh.data_world_size} data-parallel ranks of the "
                "device_mesh: some ranks would get no rows"
            )
        smallest = max(smallest, mesh.data_world_size)
    return smallest


def _fetch(dataset: SizedDataset, indices: Sequence[int]) -> list[Any]:
    """Rows at ``indices``, in one call when the dataset can read several at once (``__getitems__``)."""
    read_many = getattr(dataset, "__getitems__", None)
    return list(read_many(list(indices))) if read_many is not None else [dataset[i] for i in indices]
