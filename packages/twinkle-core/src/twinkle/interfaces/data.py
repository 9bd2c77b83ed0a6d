"""Interfaces of the data components: Preprocessor, Template, InputProcessor, dataset, DataLoader."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from twinkle.data_format import InputFeature, ToolCall, Trajectory


class Preprocessor(ABC):
    """Turns one raw row (any columns) into a :class:`Trajectory`.

    Raise :class:`twinkle.errors.InvalidInputError` for a row that cannot be
    converted: ``Dataset.map`` reports such rows by index instead of dropping
    them silently. Return ``None`` to drop a row on purpose (a filter).
    A plain function ``row -> Trajectory | None`` is accepted wherever a
    Preprocessor is.
    """

    @abstractmethod
    def preprocess(self, row: Mapping[str, Any]) -> Trajectory | None:
        """Convert one row."""

    def __call__(self, row: Mapping[str, Any]) -> Trajectory | None:
        return self.preprocess(row)


@runtime_checkable
class Template(Protocol):
    """Chat-template encoding: trajectories to token ids with a loss mask, and back."""

    max_length: int | None

    def encode(self, trajectory: Trajectory, add_generation_prompt: bool = False) -> InputFeature | None:
        """Encode one trajectory; labels cover assistant tokens unless a generation prompt is added.

        ``None`` means the trajectory was dropped on purpose (e.g. too long under a 'delete' policy).
        """
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Token ids back to text."""
        ...


@runtime_checkable
class InputProcessor(Protocol):
    """Collates encoded features into model inputs (padded or packed tensors)."""

    def __call__(self, features: Sequence[InputFeature]) -> dict[str, Any]:
        """A batch of features to a dict of tensors (``input_ids``, ``labels``, ...)."""
        ...


@runtime_checkable
class SizedDataset(Protocol):
    """What a DataLoader needs from a dataset: a length and random access."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class DataLoader(Protocol):
    """Batches of a dataset, epoch after epoch, with a position a checkpoint can save and restore.

    ``Model.save(..., dataloader=)`` records :meth:`get_state`;
    ``Model.resume_from_checkpoint(..., dataloader=)`` gives it back to :meth:`load_state`.
    """

    def __len__(self) -> int:
        """Batches per epoch."""
        ...

    def __iter__(self) -> Iterator[Any]:
        """The remaining batches of the current epoch."""
        ...

    def get_state(self) -> dict[str, Any]: ...

    def load_state(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class ToolCallParser(Protocol):
    """Splits an assistant completion into its text and its tool calls."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, tool_calls)`` of ``text``; ``content`` is the text with the parsed calls removed."""
        ...
