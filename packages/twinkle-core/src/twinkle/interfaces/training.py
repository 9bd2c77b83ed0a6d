"""Interfaces of the training components: Loss, Metric, Model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from twinkle.data_format import InputFeature, LossOutput, ModelOutput


class Loss(ABC):
    """A training objective.

    ``inputs`` is the collated batch (``labels``, ``loss_mask`` ... as tensors),
    ``outputs`` the forward result (``logps`` per token, optionally ``logits``);
    extra per-sample inputs (``advantages``, ``old_logps``, ``ref_logps``) come as
    keyword arguments. Document the formula and reduction in the docstring.

    ``required_inputs`` names the loss inputs it cannot do without; a forward
    that only wants log-probabilities (``forward_only``) skips the loss when
    they are not given instead of failing.

    ``pairwise`` marks a loss over ``2N`` sequences whose pair ``i`` is
    sequences ``i`` and ``i + N`` (preference losses). A model never cuts such
    a call into micro-batches, whose contiguous slices would separate pairs;
    under data parallelism each rank must hold whole pairs, as it does when
    the DataLoader slices a batch of pair rows and each rank lays out its own.
    """

    required_inputs: tuple[str, ...] = ()
    pairwise: bool = False

    @abstractmethod
    def __call__(self, inputs: Mapping[str, Any], outputs: ModelOutput, **loss_inputs: Any) -> LossOutput:
        """Compute the loss to back-propagate.

        When :meth:`normalizer` returns a value, the model passes it as the
        keyword ``normalizer`` and the loss divides by it instead of by its own
        batch's denominator, so micro-batch losses add up to the whole batch's.
        """

    def normalizer(self, inputs: Mapping[str, Any]) -> float | None:
        """The whole batch's denominator (e.g. its number of supervised tokens), or ``None``.

        ``None`` means the loss is a mean over its own micro-batch; the model then
        weights micro-batches by their number of samples.
        """
        return None


class Metric(ABC):
    """Accumulates values over steps and reports scalars."""

    @abstractmethod
    def accumulate(self, **values: Any) -> None:
        """Add one step's values."""

    @abstractmethod
    def calculate(self) -> dict[str, float]:
        """The current scalars, e.g. ``{'loss': 1.2, 'accuracy': 0.5}``."""

    @abstractmethod
    def reset(self) -> None:
        """Forget accumulated values."""


@runtime_checkable
class Model(Protocol):
    """The semantic training API every model back-end provides (per adapter)."""

    def forward(self, *, inputs: Sequence[InputFeature], **kwargs: Any) -> ModelOutput: ...

    def forward_only(self, *, inputs: Sequence[InputFeature], **kwargs: Any) -> ModelOutput: ...

    def forward_backward(self, *, inputs: Sequence[InputFeature], **kwargs: Any) -> ModelOutput: ...

    def clip_grad_and_step(self, **kwargs: Any) -> Any: ...

    def zero_grad(self, **kwargs: Any) -> None: ...

    def calculate_metric(self, is_training: bool = True, **kwargs: Any) -> dict[str, float]: ...

    def save(self, name: str, output_dir: str | None = None, **kwargs: Any) -> str: ...
