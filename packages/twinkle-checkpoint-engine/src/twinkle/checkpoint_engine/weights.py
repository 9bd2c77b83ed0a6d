"""What a trainer's model sends: its LoRA adapter alone, or every base weight with the adapter merged in.

Both read the trainer's tensors where they are (no copy, no serialisation);
the merged weights are produced one tensor at a time, so a full sync never
holds a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict

from twinkle.errors import ConfigurationError

# PEFT features whose effect a plain ``W + scaling * B @ A`` (or a sampler's LoRA layer) cannot carry.
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "lora_bias": "LoRA biases"}


def lora_payload(model: PeftModel, adapter_name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The adapter's ``LoraConfig`` and its PEFT-format tensors (views of the trainer's parameters)."""
    config = _checked_config(model, adapter_name)
    return config, get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)


def merged_weights(model: torch.nn.Module, adapter_name: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight under the base model's own names; LoRA layers of ``adapter_name`` as ``W + scaling·B·A``.

    Weights shared by several names (tied embeddings) are sent once. An adapter
    on a tied weight (``lm_head`` sharing the input embedding's) is refused:
    merged into the shared tensor, its update would reach the embedding too.
    """
    if not isinstance(model, PeftModel) or adapter_name is None:
        return _once(model.state_dict().items())
    _checked_config(model, adapter_name)
    base = model.get_base_model()
    lora_layers = {
        name: module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and adapter_name in module.lora_A
    }
    weights = base.state_dict()
    keys_by_tensor: dict[int, list[str]] = {}
    for key, tensor in weights.items():
        keys_by_tensor.setdefault(tensor.data_ptr(), []).append(key)
    for layer_name in lora_layers:
        weight = weights.get(f"{layer_name}.base_layer.weight")
        tied = [] if weight is None else keys_by_tensor[weight.data_ptr()]
        if len(tied) > 1:
            raise ConfigurationError(
                f"adapter {adapter_name!r} adapts {layer_name}, whose weight is tied ({', '.join(tied)}): merged, "
                "the update would change every tied use of it; sync the adapter itself (merge_and_sync=False)"
            )
    return _merged(weights, lora_layers, adapter_name)


def _merged(
    weights: dict[str, torch.Tensor], lora_layers: dict[str, LoraLayer], adapter_name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for key, tensor in _once(weights.items()):
            if any(part.startswith("lora_") for part in key.split(".")):
                continue  # adapter tensors (this adapter's are merged, others are not part of the base)
            layer_name, _, leaf = key.rpartition(".base_layer.")
            if not layer_name:
                yield key, tensor
            elif leaf == "weight" and layer_name in lora_layers:
                # peft declares get_delta_weight on each concrete LoraLayer (Linear, Embedding, Conv), not the base
                delta = lora_layers[layer_name].get_delta_weight(adapter_name)  # type: ignore[attr-defined]
                yield f"{layer_name}.weight", tensor + delta
            else:
                yield f"{layer_name}.{leaf}", tensor


def _once(items: Any) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for key, tensor in items:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            yield key, tensor


def _checked_config(model: PeftModel, adapter_name: str) -> Any:
    config = model.peft_config.get(adapter_name)
    if config is None:
        raise ConfigurationError(f"the model has no adapter {adapter_name!r}; adapters: {sorted(model.peft_config)}")
    for option, feature in _UNSUPPORTED.items():
        if getattr(config, option, None):
            raise ConfigurationError(f"adapter {adapter_name!r} uses {feature}, which weight sync does not support")
    return config
