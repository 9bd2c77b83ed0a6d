"""Learning-rate schedules with linear warm-up, as ``torch.optim.lr_scheduler.LambdaLR`` subclasses.

The factors follow the conventions of ``transformers``' schedule functions (warm-up
from 0, step ``num_warmup_steps`` at full lr), so numbers match runs made with them.
Being ``LRScheduler``s, they checkpoint with ``state_dict()`` like any torch scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from twinkle.errors import ConfigurationError
from twinkle.registry import factory, register


def _warmup(step: int, num_warmup_steps: int) -> float:
    return step / max(1, num_warmup_steps)


def _progress(step: int, num_warmup_steps: int, num_training_steps: int) -> float:
    return min(1.0, (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps))


def _check_steps(num_warmup_steps: int, num_training_steps: int | None) -> None:
    if num_warmup_steps < 0:
        raise ConfigurationError(f"num_warmup_steps must be >= 0, got {num_warmup_steps}")
    if num_training_steps is not None and num_training_steps < max(num_warmup_steps, 1):
        raise ConfigurationError(
            f"num_training_steps ({num_training_steps}) must be >= max(num_warmup_steps, 1) ({num_warmup_steps})"
        )


def _warmup_then_decay(
    num_warmup_steps: int, num_training_steps: int, min_lr_ratio: float, decay: Callable[[float], float]
) -> Callable[[int], float]:
    """The lr factor: linear warm-up, then ``decay(progress)`` (1 -> 0) rescaled to end at ``min_lr_ratio``."""
    _check_steps(num_warmup_steps, num_training_steps)

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return _warmup(step, num_warmup_steps)
        progress = _progress(step, num_warmup_steps, num_training_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay(progress)

    return factor


@register("lr_scheduler")
class CosineWarmupScheduler(LambdaLR):
    """Linear warm-up to the optimizer's lr, then cosine decay to ``min_lr_ratio × lr``.

    ``num_cycles=0.5`` is one half cosine (lr reaches the minimum at the last step).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        num_warmup_steps: int = 0,
        num_training_steps: int = 1000,
        num_cycles: float = 0.5,
        min_lr_ratio: float = 0.0,
    ) -> None:
        def cosine(progress: float) -> float:
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * progress)))

        super().__init__(optimizer, _warmup_then_decay(num_warmup_steps, num_training_steps, min_lr_ratio, cosine))


@register("lr_scheduler")
class LinearWarmupScheduler(LambdaLR):
    """Linear warm-up to the optimizer's lr, then linear decay to ``min_lr_ratio × lr``."""

    def __init__(
        self,
        optimizer: Optimizer,
        num_warmup_steps: int = 0,
        num_training_steps: int = 1000,
        min_lr_ratio: float = 0.0,
    ) -> None:
        factor = _warmup_then_decay(num_warmup_steps, num_training_steps, min_lr_ratio, lambda progress: 1.0 - progress)
        super().__init__(optimizer, factor)


@register("lr_scheduler")
class ConstantScheduler(LambdaLR):
    """Linear warm-up, then the optimizer's lr unchanged."""

    def __init__(self, optimizer: Optimizer, num_warmup_steps: int = 0) -> None:
        _check_steps(num_warmup_steps, None)
        super().__init__(optimizer, lambda step: min(1.0, _warmup(step, num_warmup_steps) if num_warmup_steps else 1.0))


@register("lr_scheduler", name="default")
@factory
def default_scheduler(
    optimizer: Optimizer,
    lr_decay_steps: int = 1000,
    max_lr: float | None = None,
    min_lr: float = 0.0,
    lr_warmup_steps: int = 0,
) -> CosineWarmupScheduler:
    """Cosine decay from ``max_lr`` to ``min_lr`` over ``lr_decay_steps`` (Megatron-style arguments).

    ``max_lr`` overrides the optimizer's lr when given.
    """
    if max_lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = max_lr
            group["initial_lr"] = max_lr
    base_lr = optimizer.param_groups[0]["lr"]
    return CosineWarmupScheduler(
        optimizer,
        num_warmup_steps=lr_warmup_steps,
        num_training_steps=lr_decay_steps,
        min_lr_ratio=min_lr / base_lr if base_lr else 0.0,
    )
