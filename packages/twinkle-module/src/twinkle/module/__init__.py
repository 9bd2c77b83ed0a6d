"""Reusable torch building blocks: LR schedulers, optimizers by name, memory-lean log-probs, per-row LoRA."""

from twinkle.module.logps import LowRankTerm, TokenLogps, chunked_token_logps, logps_dtype, token_logps_from_logits
from twinkle.module.multi_lora import (
    LoraWeights,
    MultiLoraLinear,
    RowRouting,
    adapter_names,
    adapter_rows,
    inject_multi_lora,
    multi_lora_modules,
    per_token,
    remove_adapter,
    set_adapter_weights,
)
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
    "LoraWeights",
    "LowRankTerm",
    "MultiLoraLinear",
    "RowRouting",
    "TokenLogps",
    "adapter_names",
    "adapter_rows",
    "build_optimizer",
    "chunked_token_logps",
    "default_scheduler",
    "inject_multi_lora",
    "logps_dtype",
    "multi_lora_modules",
    "optimizer_class",
    "per_token",
    "remove_adapter",
    "set_adapter_weights",
    "token_logps_from_logits",
]
