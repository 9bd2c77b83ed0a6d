"""Everything one trainable unit (a LoRA adapter, or the full model) owns besides its weights."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.interfaces import Loss, Metric
from twinkle.model.training_metric import TrainingMetric
from twinkle.registry import build

FULL_MODEL = "__full_model__"  # the state key when no adapter is used


@dataclass
class TrainState:
    """Per-adapter components and counters; adapters never share any of these."""

    name: str
    params: list[torch.nn.Parameter]
    loss: Loss
    processor: Any
    gradient_accumulation_steps: int = 1
    template: Any = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    metrics: list[Metric] = field(default_factory=list)
    train_metric: TrainingMetric = field(default_factory=TrainingMetric)
    eval_metric: TrainingMetric = field(default_factory=TrainingMetric)
    accumulated: int = 0  # forward_backward calls since the last optimizer step
    global_step: int = 0  # optimizer steps taken
    pending: Any = None  # (batch, outputs, loss) of the last fine-grained forward/calculate_loss
    configured: bool = False  # a set_* call chose one of its components

    @property
    def in_use(self) -> bool:
        """Whether it was set up or trained; an untouched implicit full-model state may give way to adapters."""
        return self.configured or self.optimizer is not None or self.accumulated > 0 or self.global_step > 0

    @property
    def is_adapter(self) -> bool:
        return self.name != FULL_MODEL

    def require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            who = f"adapter {self.name!r}" if self.is_adapter else "the model"
            raise ConfigurationError(f"no optimizer for {who}: call set_optimizer('AdamW', lr=...) first")
        return self.optimizer

    def current_lr(self) -> float | None:
        return None if self.optimizer is None else float(self.optimizer.param_groups[0]["lr"])

    def update_optimizer(self, hyperparameters: Mapping[str, Any]) -> None:
        """Set ``hyperparameters`` on every param group in place (state kept); unknown keys are rejected first."""
        optimizer = self.require_optimizer()
        for key, value in hyperparameters.items():
            if key == "params" or any(key not in group for group in optimizer.param_groups):
                known = sorted(k for k in optimizer.param_groups[0] if k != "params")
                raise InvalidInputError(f"{type(optimizer).__name__} has no hyper-parameter {key!r}; known: {known}")
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key == "lr" and not (is_number and 0 <= value < math.inf):
                raise InvalidInputError(f"lr must be a finite number >= 0, got {value!r}")
        for group in optimizer.param_groups:
            group.update(hyperparameters)

    def report(self, is_training: bool) -> dict[str, float]:
        """Metrics since the previous report (then reset): loss, accuracy, grad_norm, lr, tokens/s, user metrics."""
        metric = self.train_metric if is_training else self.eval_metric
        metric.accumulate(lr=self.current_lr())
        result = {**metric.calculate(), "global_step": float(self.global_step)}
        metric.reset()
        for user_metric in self.metrics:
            result.update(user_metric.calculate())
            user_metric.reset()
        return result

    def counters(self) -> dict[str, int]:
        return {
            "global_step": self.global_step,
            "accumulated": self.accumulated,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }


def check_gradient_accumulation_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigurationError(f"gradient_accumulation_steps must be an int >= 1, got {steps!r}")


def new_state(
    name: str, params: list[torch.nn.Parameter], gradient_accumulation_steps: int, pad_token_id: int
) -> TrainState:
    """A state with the default loss (cross-entropy) and processor (padding with ``pad_token_id``)."""
    processor = build("processor", "InputProcessor")
    processor.pad_token_id = pad_token_id
    return TrainState(
        name=name,
        params=params,
        loss=build("loss", "CrossEntropyLoss"),
        processor=processor,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )


def check_new_adapter(states: Mapping[str, TrainState], adapter_name: str, gradient_accumulation_steps: int) -> None:
    """Reject a bad name or accumulation count, a taken name, or a model already training all weights."""
    if not isinstance(adapter_name, str) or not adapter_name or "." in adapter_name:
        raise ConfigurationError(f"adapter_name must be a non-empty string without dots, got {adapter_name!r}")
    if adapter_name in states:
        raise ConfigurationError(f"adapter {adapter_name!r} already exists; pick another name")
    full_model = states.get(FULL_MODEL)
    if full_model is not None and full_model.in_use:
        raise ConfigurationError(
            "this model is set up for full-parameter training (components set or gradients taken); "
            "add adapters before anything else"
        )
    check_gradient_accumulation_steps(gradient_accumulation_steps)


def find_state(states: Mapping[str, TrainState], adapter_name: str | None) -> TrainState:
    """The state of ``adapter_name``, or the only one when ``None``; a clear error otherwise."""
    adapters = [name for name in states if name != FULL_MODEL]
    if adapter_name is not None:
        if adapter_name not in states:
            raise ConfigurationError(f"unknown adapter {adapter_name!r}; adapters: {adapters}")
        return states[adapter_name]
    if len(states) == 1:
        return next(iter(states.values()))
    raise ConfigurationError(f"this model has several adapters {adapters}: pass adapter_name=")
