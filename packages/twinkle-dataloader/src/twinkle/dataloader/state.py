"""``LoaderState``: where a DataLoader is, saved in a checkpoint so training resumes on the next batch."""

from __future__ import annotations

from dataclasses import dataclass, fields

from twinkle.data_format import Serializable
from twinkle.errors import ConfigurationError, InvalidInputError

# Settings that decide which rows form each batch; a state only fits a loader with the same ones.
_FINGERPRINT: tuple[str, ...] = ("dataset_length", "batch_size", "min_batch_size", "shuffle")


@dataclass(frozen=True)
class LoaderState(Serializable):
    """Position (``epoch``, ``batches_consumed`` in it), ``seed``, and the fingerprint of the batching."""

    epoch: int
    batches_consumed: int
    seed: int
    dataset_length: int
    batch_size: int
    min_batch_size: int
    shuffle: bool

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            expected = bool if field.name == "shuffle" else int
            if type(value) is not expected:
                raise InvalidInputError(f"DataLoader state: {field.name} must be {expected.__name__}, got {value!r}")
        if self.epoch < 0 or self.batches_consumed < 0:
            raise InvalidInputError(f"DataLoader state: negative position {self.epoch=}, {self.batches_consumed=}")

    def check_fits(self, current: LoaderState) -> None:
        """Raise if this saved state was made with different batching than ``current``'s loader."""
        diffs = [
            f"{name}={getattr(self, name)!r} (this loader: {getattr(current, name)!r})"
            for name in _FINGERPRINT
            if getattr(self, name) != getattr(current, name)
        ]
        if diffs:
            raise ConfigurationError(
                "cannot resume: the DataLoader state was saved with "
                + ", ".join(diffs)
                + "; resume with the same dataset and batch settings"
            )
