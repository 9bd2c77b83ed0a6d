"""The optimizer half of the training API: clip, step, zero, schedule, on one adapter's state at a time.

Gradients the model's wrapper does not finish in backward (expert-parallel experts, tensor-parallel
shards) are finished by the parallel plan (``sync_gradients``) before any of them is read.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.model.parallel import Parallelism
from twinkle.model.train_state import TrainState


class OptimizerCalls(ABC):
    """Mixed into :class:`~twinkle.model.training_model.TrainingModel`, which provides the three members below."""

    model: Any
    parallel: Parallelism

    @abstractmethod
    def train_state(self, adapter_name: str | None) -> TrainState:
        """The state of adapter ``adapter_name`` (or of the full model), with its parameters and optimizer."""

    def update_optimizer(self, adapter_name: str | None = None, **hyperparameters: Any) -> None:
        """Set hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``...) of the existing optimizer in place.

        Its state (e.g. Adam moments) is kept. Only keys its param groups already
        have are accepted. An LR scheduler, if set, may override ``lr`` on its next step.
        """
        self.train_state(adapter_name).update_optimizer(hyperparameters)

    def clip_grad_norm(self, max_grad_norm: float = 1.0, adapter_name: str | None = None) -> float:
        """Clip this adapter's gradients to ``max_grad_norm`` (L2); returns the norm before clipping."""
        state = self.train_state(adapter_name)
        norm = self.parallel.clip_grad_norm(self.model, state.params, max_grad_norm)
        state.train_metric.accumulate(grad_norm=norm)
        return norm

    def step(self, adapter_name: str | None = None) -> None:
        """One optimizer step on the accumulated gradients."""
        state = self.train_state(adapter_name)
        optimizer = state.require_optimizer()
        self.parallel.sync_gradients(self.model, state.params)
        optimizer.step()
        state.global_step += 1
        state.accumulated = 0

    def zero_grad(self, adapter_name: str | None = None) -> None:
        """Drop this adapter's gradients (other adapters keep theirs)."""
        state = self.train_state(adapter_name)
        for param in state.params:
            param.grad = None
        state.accumulated = 0  # the dropped gradients no longer count towards gradient_accumulation_steps

    def lr_step(self, adapter_name: str | None = None) -> None:
        """Advance the LR scheduler, if one is set."""
        state = self.train_state(adapter_name)
        if state.lr_scheduler is not None:
            state.lr_scheduler.step()

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, adapter_name: str | None = None) -> dict[str, Any]:
        """Clip, step, zero and advance the schedule once ``gradient_accumulation_steps`` calls have accumulated."""
        state = self.train_state(adapter_name)
        state.require_optimizer()
        if state.accumulated < state.gradient_accumulation_steps:
            return {"stepped": False, "accumulated": state.accumulated}
        name = state.name if state.is_adapter else None
        grad_norm = self.clip_grad_norm(max_grad_norm, adapter_name=name)
        if not math.isfinite(grad_norm):  # a finite loss can still have a NaN/inf gradient
            self.zero_grad(name)
            raise InvalidInputError(
                f"the gradient norm is {grad_norm}: the optimizer step was skipped and the accumulated "
                "gradients dropped, so the weights are unchanged"
            )
        self.step(name)
        self.zero_grad(name)
        self.lr_step(name)
        return {"stepped": True, "grad_norm": grad_norm, "lr": state.current_lr(), "global_step": state.global_step}
