"""What a trainer's model sends: its LoRA adapter alone, or every base weight with the adapter merged in.

Both read the trainer's tensors where they are (no copy, no serialisation);
the merged weights are produced one tensor at a time, so a full sync never
holds a second copy of the model. A model sharded by FSDP2 (DTensor weights)
is read whole, one tensor at a time: a collective, so every rank of the model
reads, in the same order (under torchrun each rank syncs; on Ray every worker
of the model's actor reads).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict
from torch.distributed.tensor import DTensor

from twinkle.errors import ConfigurationError

# PEFT features whose effect a plain ``W + scaling * B @ A`` (or a sampler's LoRA layer) cannot carry.
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "lora_bias": "LoRA biases"}


def lora_payload(model: PeftModel, adapter_name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The adapter's ``LoraConfig`` and its PEFT-format tensors (views of the trainer's parameters)."""
    config = _checked_config(model, adapter_name)
    tensors = get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
    return config, {key: _whole(tensor) for key, tensor in tensors.items()}


def merged_weights(model: torch.nn.Module, adapter_name: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight under the base model's own names; LoRA layers of ``adapter_name`` as ``W + scaling·B·A``.

    Weights shared by several names (tied embeddings) are sent once. An adapter
    on a tied weight (``lm_head`` sharing the input embedding's) is refused:
    merged into the shared tensor, its update would reach the embedding too.
    """
    if not isinstance(model, PeftModel) or adapter_name is None:
        return _whole_once(model.state_dict().items(), _identities(model))
    _checked_config(model, adapter_name)
    base = model.get_base_model()
    lora_layers = {
        name: module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and adapter_name in module.lora_A
    }
    weights = base.state_dict()
    identities = _identities(base)
    keys_by_tensor: dict[Hashable, list[str]] = {}
    for key in weights:
        keys_by_tensor.setdefault(identities.get(key, key), []).append(key)
    for layer_name in lora_layers:
        key = f"{layer_name}.base_layer.weight"
        tied = keys_by_tensor[identities.get(key, key)] if key in weights else []
        if len(tied) > 1:
            raise ConfigurationError(
                f"adapter {adapter_name!r} adapts {layer_name}, whose weight is tied ({', '.join(tied)}): merged, "
                "the update would change every tied use of it; sync the adapter itself (merge_and_sync=False)"
            )
    return _merged(weights, identities, lora_layers, adapter_name)


def _merged(
    weights: dict[str, torch.Tensor], identities: dict[str, int], lora_layers: dict[str, LoraLayer], adapter_name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for key, tensor in _whole_once(weights.items(), identities):
            if any(part.startswith("lora_") for part in key.split(".")):
                continue  # adapter tensors (this adapter's are merged, others are not part of the base)
            layer_name, _, leaf = key.rpartition(".base_layer.")
            if not layer_name:
                yield key, tensor
            elif leaf == "weight" and layer_name in lora_layers:
                # peft declares get_delta_weight on each concrete LoraLayer (Linear, Embedding, Conv), not the base
                delta = lora_layers[layer_name].get_delta_weight(adapter_name)  # type: ignore[attr-defined]
                yield f"{layer_name}.weight", tensor + _whole(delta)
            else:
                yield f"{layer_name}.{leaf}", tensor


def _whole_once(items: Any, identities: dict[str, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each distinct weight once (tied names share one), whole; an entry that is no parameter or buffer is its own."""
    seen: set[Hashable] = set()
    for key, tensor in items:
        identity = identities.get(key, key)
        if identity not in seen:
            seen.add(identity)
            yield key, _whole(tensor)


def _identities(module: torch.nn.Module) -> dict[str, int]:
    """Which state-dict entries are one tensor (tied weights), by the module's structure.

    Not by data pointer: that of a rank's FSDP2 shard differs between ranks (an empty shard has none), and
    every rank must read the same tensors in the same order.
    """
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {name: id(tensor) for name, tensor in named}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a shard of FSDP2) gathered whole from every rank; any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _checked_config(model: PeftModel, adapter_name: str) -> Any:
    config = model.peft_config.get(adapter_name)
    if config is None:
        raise ConfigurationError(f"the model has no adapter {adapter_name!r}; adapters: {sorted(model.peft_config)}")
    for option, feature in _UNSUPPORTED.items():
        if getattr(config, option, None):
            raise ConfigurationError(f"adapter {adapter_name!r} uses {feature}, which weight sync does not support")
    return config
