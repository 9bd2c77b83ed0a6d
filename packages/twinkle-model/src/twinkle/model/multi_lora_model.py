"""``MultiLoraModel``: many tenants' LoRA adapters on one frozen base model, trained together.

Every adapter has its own rank, alpha, target modules and dropout, and — as in
:class:`TransformersModel` — its own optimizer, LR scheduler, loss, template,
processor, gradient-accumulation state and metrics. Adapters are plain
parameters served by ``MultiLoraLinear`` layers, which compute the base
projection once for a whole batch and each adapter's low-rank update only on
its own rows. So :meth:`MultiLoraModel.forward_backward_many` trains several
adapters, each with its own loss, in **one** forward and backward pass; every
single-adapter call of the :class:`TrainingModel` API works too.

Adapters can be added and removed at run time; the base model is never
reloaded, and a removed adapter's tensors, gradients and optimizer state are
released.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig

from twinkle.errors import ConfigurationError
from twinkle.infra import remote_class
from twinkle.model.multi_lora_adapters import MultiLoraAdapter, create_adapter
from twinkle.model.passes.multimodal import multimodal_base
from twinkle.model.shared_passes import SharedPasses
from twinkle.model.train_state import TrainState
from twinkle.module import ImageRows, adapter_rows, read_adapter_dir, remove_adapter, write_adapter_dir
from twinkle.registry import register


@register("model")
@remote_class
class MultiLoraModel(SharedPasses):
    """Up to ``max_loras`` resident LoRA adapters of rank at most ``max_rank`` over one frozen base model.

    Other arguments are :class:`TrainingModel`'s. See the module docstring and :class:`SharedPasses`.
    """

    supports_data_parallel = False  # its shared passes run outside a DDP/FSDP wrapper

    def __init__(self, model_id: str | None = None, max_loras: int = 8, max_rank: int = 64, **kwargs: Any) -> None:
        super().__init__(model_id, max_loras, max_rank, **kwargs)
        self._adapters: dict[str, MultiLoraAdapter] = {}

    def _add_adapter(self, adapter_name: str, config: PeftConfig, directory: Path | None) -> list[torch.nn.Parameter]:
        self._check_capacity()
        adapter = create_adapter(self.model, adapter_name, config, self.max_rank)
        try:
            if directory:
                adapter.load_state_dict(adapter_name, read_adapter_dir(directory)[1])
        except Exception:
            remove_adapter(self.model, adapter_name)
            raise
        self._adapters[adapter_name] = adapter
        return adapter.parameters()

    def _drop_adapter(self, adapter_name: str) -> None:
        remove_adapter(self.model, adapter_name)
        del self._adapters[adapter_name]

    def adapter_config(self, adapter_name: str) -> LoraConfig:
        self.train_state(adapter_name)
        return self._adapters[adapter_name].config

    # ------------------------------------------------------------------ weight sync (CheckpointEngineManager)

    def lora_payload(self, adapter_name: str) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
        """The adapter's config and PEFT-format tensors (views of the trained parameters)."""
        self.train_state(adapter_name)
        adapter = self._adapters[adapter_name]
        return adapter.config, adapter.state_dict()

    def merged_weights(self, adapter_name: str | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Every base weight under its own name, with the adapter merged in (``W + scaling·B·A``), one at a time.

        An adapter on a weight that is tied to another (``lm_head`` sharing the
        input embedding's) is refused: merged into the shared tensor, its
        update would reach the embedding too.
        """
        name = self.train_state(adapter_name).name
        adapter = self._adapters[name]
        weights = self.model.state_dict()
        keys_by_tensor: dict[int, list[str]] = {}
        for key, tensor in weights.items():
            keys_by_tensor.setdefault(tensor.data_ptr(), []).append(key)
        for module in adapter.weights:
            tied = keys_by_tensor[weights[_weight_key(module, weights)].data_ptr()]
            if len(tied) > 1:
                raise ConfigurationError(
                    f"adapter {name!r} adapts {module}, whose weight is tied ({', '.join(tied)}): merged, the "
                    "update would change every tied use of it; sync the adapter itself (merge_and_sync=False)"
                )
        return self._merged(adapter, weights)

    @staticmethod
    def _merged(adapter: MultiLoraAdapter, weights: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        with torch.no_grad():
            for key, tensor in weights.items():
                if tensor.data_ptr() in seen:  # tied weights go once
                    continue
                seen.add(tensor.data_ptr())
                # A linear layer's target is its module, an adapted parameter's the parameter itself.
                target = key if key in adapter.weights else key.removesuffix(".weight")
                if target in adapter.weights and _weight_key(target, weights) == key:
                    yield key, tensor + adapter.delta_weight(target, tensor)
                else:
                    yield key, tensor

    # ------------------------------------------------------------------ back-end hooks

    def _route_rows(self, row_adapters: Sequence[str | None], batch: Mapping[str, torch.Tensor] | None) -> Any:
        images = None
        if batch is not None and "image_grid_thw" in batch:  # adapters on the vision tower route its patches
            tower = multimodal_base(self.model).visual
            images = ImageRows.of_batch(tower, batch["mm_token_type_ids"], batch["image_grid_thw"])
        return adapter_rows(self.model, row_adapters, images)

    def adapter_state_dict(self, state: TrainState) -> dict[str, torch.Tensor]:
        return self._adapters[state.name].state_dict()

    def write_adapter_files(self, state: TrainState, directory: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        adapter = self._adapters[state.name]
        adapter.config.base_model_name_or_path = self.model_path
        write_adapter_dir(directory, adapter.config, tensors)

    def load_adapter_weights(self, adapter_name: str, directory: Path) -> None:
        self._adapters[adapter_name].load_state_dict(adapter_name, read_adapter_dir(directory)[1])


def _weight_key(target: str, weights: Mapping[str, torch.Tensor]) -> str:
    """The state-dict key of what ``target`` adapts: a parameter's own name, or a linear layer's ``.weight``."""
    return target if target in weights else f"{target}.weight"
