"""Reusable torch building blocks: LR schedulers, optimizers by name, memory-lean log-probs, per-row LoRA."""

from twinkle.module.logps import LowRankTerm, TokenLogps, chunked_token_logps, logps_dtype, token_logps_from_logits
from twinkle.module.lora_format import (
    ADAPTER_CONFIG,
    check_lora_config,
    lora_targets,
    parameter_keys,
    pattern_value,
    read_adapter_dir,
    split_lora_state_dict,
    write_adapter_dir,
)
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
from twinkle.module.multi_lora_images import ImageRows, images_per_row
from twinkle.module.multi_lora_params import (
    ExpertLora,
    MultiLoraExperts,
    MultiLoraRouter,
    RouterLora,
    is_fused_experts,
    parameter_lora_layer,
    parameter_lora_modules,
)
from twinkle.module.optimizer import build_optimizer, optimizer_class
from twinkle.module.routing import RoutingRecord, record_routing, replay_routing, topk_routers
from twinkle.module.scheduler import (
    ConstantScheduler,
    CosineWarmupScheduler,
    LinearWarmupScheduler,
    default_scheduler,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ConstantScheduler",
    "CosineWarmupScheduler",
    "ExpertLora",
    "ImageRows",
    "LinearWarmupScheduler",
    "LoraWeights",
    "LowRankTerm",
    "MultiLoraExperts",
    "MultiLoraLinear",
    "MultiLoraRouter",
    "RouterLora",
    "RoutingRecord",
    "RowRouting",
    "TokenLogps",
    "adapter_names",
    "adapter_rows",
    "build_optimizer",
    "check_lora_config",
    "chunked_token_logps",
    "default_scheduler",
    "images_per_row",
    "inject_multi_lora",
    "is_fused_experts",
    "logps_dtype",
    "lora_targets",
    "multi_lora_modules",
    "optimizer_class",
    "parameter_keys",
    "parameter_lora_layer",
    "parameter_lora_modules",
    "pattern_value",
    "per_token",
    "read_adapter_dir",
    "record_routing",
    "remove_adapter",
    "replay_routing",
    "set_adapter_weights",
    "split_lora_state_dict",
    "token_logps_from_logits",
    "topk_routers",
    "write_adapter_dir",
]
