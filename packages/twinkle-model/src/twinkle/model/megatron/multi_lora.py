"""``MultiLoraMegatronModel``: many tenants' LoRA adapters on one megatron-core base, trained together.

:class:`MegatronModel` keeps every adapter's pairs beside the base's (tensor- and pipeline-parallel)
layers and routes each batch row to its own adapter (:class:`.lora.MegatronLora`), so the shared passes
of :class:`twinkle.model.shared_passes.SharedPasses` run on it as they run on transformers'
``MultiLoraModel``: one forward and backward over several adapters' requests, each with its own loss,
optimizer and schedule, equal to training each alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig

from twinkle.errors import ConfigurationError
from twinkle.infra import remote_class
from twinkle.model.megatron.megatron_model import MegatronModel
from twinkle.model.shared_passes import SharedPasses
from twinkle.registry import register


@register("model")
@remote_class
class MultiLoraMegatronModel(MegatronModel, SharedPasses):  # MegatronModel first: its weight sync is concrete
    """Up to ``max_loras`` resident LoRA adapters of rank at most ``max_rank`` over one frozen megatron-core base.

    Other arguments are :class:`MegatronModel`'s (``device_mesh`` with ``tp_size``, ``pp_size``, ``dp_size``).
    """

    def __init__(self, model_id: str | None = None, max_loras: int = 8, max_rank: int = 64, **kwargs: Any) -> None:
        # SharedPasses' own: MegatronModel's __init__ is TrainingModel's (as remote_class wrapped it).
        SharedPasses.__init__(self, model_id, max_loras, max_rank, **kwargs)

    def _add_adapter(self, adapter_name: str, config: PeftConfig, directory: Path | None) -> list[torch.nn.Parameter]:
        self._check_capacity()
        if isinstance(config, LoraConfig):  # r, and every rank_pattern's rank
            ranks = {"r": config.r, **(config.rank_pattern or {})}
            wrong = {key: rank for key, rank in ranks.items() if not 1 <= int(rank) <= self.max_rank}
            if wrong:
                raise ConfigurationError(f"adapter {adapter_name!r}: ranks {wrong} are outside 1..{self.max_rank}")
        return super()._add_adapter(adapter_name, config, directory)

    def _drop_adapter(self, adapter_name: str) -> None:
        self.model.lora.remove(adapter_name)

    def adapter_config(self, adapter_name: str) -> LoraConfig:
        self.train_state(adapter_name)
        return self.model.lora.configs[adapter_name]
