"""LoRA adapters in PEFT's format: read and write saved directories, split and join state dicts.

PEFT writes ``adapter_config.json`` and ``adapter_model.safetensors`` whose keys
look like ``base_model.model.<module>.lora_A.weight`` (the adapter name left
out); ``peft.get_peft_model_state_dict`` returns the same keys in memory. Only
plain LoRA on linear layers is served: variants that change the forward
(DoRA, LoRA biases, embedding adapters, fully trained ``modules_to_save``) are
refused by name instead of being silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from twinkle.errors import ConfigurationError, ResourceNotFoundError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
}


def config_option(config: Any, key: str, default: Any = None) -> Any:
    """A field of a ``peft.LoraConfig`` or of its dict form (``adapter_config.json``)."""
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    return default if value is None else value


def check_lora_config(name: str, config: Any) -> None:
    """Refuse configs a plain ``x @ A.T @ B.T * scaling`` update cannot reproduce."""
    peft_type = str(config_option(config, "peft_type", "LORA"))
    if peft_type.rsplit(".", 1)[-1].upper() != "LORA":
        raise ConfigurationError(f"adapter {name!r} is a {peft_type} adapter; samplers serve LoRA adapters only")
    for key, feature in _UNSUPPORTED.items():
        if config_option(config, key):
            raise ConfigurationError(f"adapter {name!r} uses {feature}, which samplers do not support")


def split_lora_state_dict(
    name: str, config: Any, state_dict: Mapping[str, torch.Tensor]
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """``{module: (A_RI, B_OR)}`` and ``{module: scaling}`` from a PEFT-format LoRA state dict.

    Ranks come from the tensors (so ``rank_pattern`` needs no special case);
    ``lora_alpha`` is looked up per module through ``alpha_pattern`` like PEFT
    does, and ``use_rslora`` scales by ``alpha / sqrt(r)`` instead of ``alpha / r``.
    """
    check_lora_config(name, config)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = _KEY.match(key)
        if match is None and key.endswith(".base_layer.weight"):
            raise ConfigurationError(
                f"adapter {name!r}: {key!r} is a base weight, which PEFT saves beside the adapter when an "
                "embedding or lm_head is targeted; save with save_embedding_layers=False to keep the adapter alone"
            )
        if match is None:
            raise ConfigurationError(f"adapter {name!r}: {key!r} is not a LoRA A/B weight of a linear layer")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise ConfigurationError(f"adapter {name!r} has no LoRA weights")
    tensors, scaling = {}, {}
    alpha, alpha_pattern = config_option(config, "lora_alpha", 8), config_option(config, "alpha_pattern", {})
    rslora = bool(config_option(config, "use_rslora", False))
    for module, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise ConfigurationError(f"adapter {name!r}: {module} has lora_{next(iter(pair))} but not its partner")
        rank = pair["A"].shape[0]
        module_alpha = pattern_value(alpha_pattern, module, alpha)
        tensors[module] = (pair["A"], pair["B"])
        scaling[module] = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
    return tensors, scaling


def pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: the first pattern matching a dotted suffix of the module name wins."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def join_lora_state_dict(tensors_by_module: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The PEFT-format state dict of ``{module: (A_RI, B_OR)}`` (the inverse of :func:`split_lora_state_dict`)."""
    state_dict = {}
    for module, (A_RI, B_OR) in tensors_by_module.items():
        state_dict[f"base_model.model.{module}.lora_A.weight"] = A_RI
        state_dict[f"base_model.model.{module}.lora_B.weight"] = B_OR
    return state_dict


def read_adapter_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config (as a dict) and weights of an adapter saved by PEFT's ``save_pretrained``."""
    directory = Path(path)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    for file in (config_file, weights_file):
        if not file.is_file():
            raise ResourceNotFoundError(f"{directory} is not a saved LoRA adapter: {file.name} is missing")
    return json.loads(config_file.read_text()), load_file(str(weights_file))


def write_adapter_dir(directory: Path, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Save an adapter in PEFT's format (what vLLM and ``PeftModel.from_pretrained`` load)."""
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(config, "save_pretrained"):  # a peft config object knows its own serialisation
        config.save_pretrained(str(directory))
    else:
        (directory / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2))
    tensors = {key: tensor.detach().contiguous().cpu() for key, tensor in state_dict.items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
