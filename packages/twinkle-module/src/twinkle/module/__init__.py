"""Reusable torch building blocks: LR schedulers, optimizers by name, memory-lean log-probs."""

from twinkle.module.logps import TokenLogps, chunked_token_logps, token_logps_from_logits
from twinkle.module.optimizer import build_optimizer, optimizer_class
from twinkle.module.scheduler import (
    ConstantScheduler,
    CosineWarmupScheduler,
    LinearWarmupScheduler,
    default_scheduler,
)

__all__ = [
    "ConstantScheduler",
    "CosineWarmupScheduler",
    "LinearWarmupScheduler",
    "TokenLogps",
    "build_optimizer",
    "chunked_token_logps",
    "default_scheduler",
    "optimizer_class",
    "token_logps_from_logits",
]
