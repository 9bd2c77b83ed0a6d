"""Interfaces of the training components: Loss, Metric, Model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from twinkle.data_format import LossOutput, ModelOutput
from twinkle.interfaces.data import DataLoader


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
    def accumulate(self, *args: Any, **values: Any) -> None:
        """Add one step's values; each metric names its own (``DPOMetric(chosen_rewards, rejected_rewards)``)."""

    @abstractmethod
    def calculate(self) -> dict[str, float]:
        """The current scalars, e.g. ``{'loss': 1.2, 'accuracy': 0.5}``."""

    @abstractmethod
    def reset(self) -> None:
        """Forget accumulated values."""


@runtime_checkable
class Model(Protocol):
    """The semantic training API every model back-end provides.

    Each call acts on one LoRA adapter (``adapter_name``; it may be omitted
    while the model has one) or, without adapters, on all weights.
    ``inputs`` is a list of ``InputFeature`` dicts, trajectories (encoded with
    the model's template) or an already collated batch; ``loss_inputs`` are
    the loss's per-sample inputs (``advantages``, ``old_logps``, ...).
    ``twinkle.model.TrainingModel`` documents each call.
    """

    @property
    def adapter_names(self) -> list[str]: ...

    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: Any,
        gradient_accumulation_steps: int = 1,
        seed: int | None = None,
    ) -> None:
        """Add a LoRA adapter from its config (a ``LoraConfig`` or a dict of its arguments) or a saved directory."""
        ...

    def set_optimizer(self, optimizer_cls: Any = "AdamW", adapter_name: str | None = None, **kwargs: Any) -> None: ...

    def set_lr_scheduler(self, scheduler_cls: Any, adapter_name: str | None = None, **kwargs: Any) -> None: ...

    def set_loss(self, loss: Any, adapter_name: str | None = None, **kwargs: Any) -> None: ...

    def set_processor(self, processor: Any, adapter_name: str | None = None, **kwargs: Any) -> None: ...

    def set_template(self, template: Any, adapter_name: str | None = None, **kwargs: Any) -> None: ...

    def add_metric(self, metric: Any, adapter_name: str | None = None, **kwargs: Any) -> None: ...

    def forward(self, inputs: Any, adapter_name: str | None = None) -> ModelOutput: ...

    def calculate_loss(self, adapter_name: str | None = None, **loss_inputs: Any) -> LossOutput: ...

    def backward(self, adapter_name: str | None = None) -> None: ...

    def forward_backward(
        self, inputs: Any, micro_batch_size: int | None = None, adapter_name: str | None = None, **loss_inputs: Any
    ) -> ModelOutput: ...

    def forward_only(
        self, inputs: Any, adapter_name: str | None = None, return_logits: bool = False, **loss_inputs: Any
    ) -> ModelOutput: ...

    def clip_grad_norm(self, max_grad_norm: float = 1.0, adapter_name: str | None = None) -> float: ...

    def step(self, adapter_name: str | None = None) -> None: ...

    def zero_grad(self, adapter_name: str | None = None) -> None: ...

    def lr_step(self, adapter_name: str | None = None) -> None: ...

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, adapter_name: str | None = None) -> dict[str, Any]: ...

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]: ...

    def save(
        self,
        name: str,
        output_dir: str | Path | None = None,
        save_optimizer: bool = True,
        adapter_name: str | None = None,
        dataloader: DataLoader | None = None,
    ) -> str:
        """Write checkpoint ``name``; returns its path (a ``dataloader``'s position is saved with it)."""
        ...

    def load(self, path: str | Path, adapter_name: str | None = None, load_optimizer: bool = False) -> None: ...

    def resume_from_checkpoint(
        self, path: str | Path, adapter_name: str | None = None, dataloader: DataLoader | None = None
    ) -> None:
        """Restore weights, optimizer, scheduler, step counters, RNG and the dataloader's position."""
        ...
