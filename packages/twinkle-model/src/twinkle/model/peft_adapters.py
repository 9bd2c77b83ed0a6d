"""LoRA adapters through PEFT: add several named adapters to one model, save and load them.

Adapters are saved in PEFT's own format (``adapter_config.json`` +
``adapter_model.safetensors``, keys without the adapter name), so a plain
``PeftModel.from_pretrained(base, path)`` loads any of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from twinkle.errors import ConfigurationError, ResourceNotFoundError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_LORA_WEIGHT = re.compile(r"\.(lora_[AB])\.weight$")  # a saved key; the parameter has the adapter's name inside


def as_peft_config(config: PeftConfig | Mapping[str, Any]) -> PeftConfig:
    """Accept a PEFT config or a dict of ``LoraConfig`` arguments."""
    if isinstance(config, PeftConfig):
        return config
    if isinstance(config, Mapping):
        try:
            return LoraConfig(**config)
        except TypeError as exc:
            raise ConfigurationError(f"invalid LoRA config {dict(config)}: {exc}") from exc
    raise ConfigurationError(f"adapter config must be a peft LoraConfig or a dict, got {type(config).__name__}")


def add_adapter(model: torch.nn.Module, name: str, config: PeftConfig) -> PeftModel:
    """Add adapter ``name``; the first one wraps the model into a ``PeftModel``."""
    config.inference_mode = False
    try:
        if isinstance(model, PeftModel):
            model.add_adapter(name, config)
            return model
        return get_peft_model(model, config, adapter_name=name)
    except ValueError as exc:  # unknown target modules and similar
        raise ConfigurationError(f"cannot add adapter {name!r}: {exc}") from exc


def adapter_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """The trainable tensors that belong to adapter ``name`` (LoRA A/B, modules_to_save copies)."""
    marker = f".{name}."
    params = [p for n, p in model.named_parameters() if marker in n]
    for param in params:
        param.requires_grad_(True)
    return params


def adapter_state_dict(model: PeftModel, name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name``'s tensors under PEFT's saved keys (the adapter name left out).

    PEFT would also save the frozen base weight of a targeted ``lm_head`` or
    embedding (``save_embedding_layers='auto'``); it never trains here, and the
    adapter loads without it, so only the adapter's own tensors are kept.
    """
    return get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)


def save_adapter(
    model: PeftModel, name: str, directory: Path, base_model_path: str, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Write adapter ``name``'s config and ``tensors`` (from :func:`adapter_state_dict`) in PEFT's format."""
    config = model.peft_config[name]
    config.base_model_name_or_path = base_model_path
    config.save_pretrained(str(directory))
    state = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(state, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_adapter_config(directory: Path) -> PeftConfig:
    if not (directory / ADAPTER_CONFIG).is_file():
        raise ResourceNotFoundError(f"{directory} is not a LoRA adapter checkpoint (no {ADAPTER_CONFIG})")
    return PeftConfig.from_pretrained(str(directory))


def load_adapter_weights(
    model: PeftModel,
    name: str,
    directory: Path,
    local_part: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Load the weights saved by :func:`save_adapter` into the existing adapter ``name``.

    ``local_part(param, saved)`` cuts a saved tensor to what this process holds of it (expert parallelism).
    """
    state = load_file(str(directory / ADAPTER_WEIGHTS), device=str(next(model.parameters()).device))
    if local_part is not None:
        params = dict(model.named_parameters())
        for key, tensor in state.items():
            param = params.get(_LORA_WEIGHT.sub(rf".\1.{name}.weight", key))
            if param is not None:
                state[key] = local_part(param, tensor)
    result = set_peft_model_state_dict(model, state, adapter_name=name)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ConfigurationError(f"adapter checkpoint {directory} does not match adapter {name!r}: {unexpected[:3]}")
