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
from collections.abc import Iterable, Mapping
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


def check_lora_keys(name: str, state_dict: Mapping[str, Any]) -> None:
    """Refuse a state dict holding anything but LoRA ``A``/``B`` weights, naming the first such key."""
    for key in state_dict:
        if _KEY.match(key) is None and key.endswith(".base_layer.weight"):
            raise ConfigurationError(
                f"adapter {name!r}: {key!r} is a base weight, which PEFT saves beside the adapter when an "
                "embedding or lm_head is targeted; save with save_embedding_layers=False to keep the adapter alone"
            )
        if _KEY.match(key) is None:
            raise ConfigurationError(f"adapter {name!r}: {key!r} is not a LoRA A/B weight of a linear layer")


def split_lora_state_dict(
    name: str, config: Any, state_dict: Mapping[str, torch.Tensor], model: torch.nn.Module | None = None
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    """``{module: (A_RI, B_OR)}`` and ``{module: scaling}`` from a PEFT-format LoRA state dict.

    Ranks come from the tensors (so ``rank_pattern`` needs no special case);
    ``lora_alpha`` is looked up per module through ``alpha_pattern`` like PEFT
    does, and ``use_rslora`` scales by ``alpha / sqrt(r)`` instead of ``alpha / r``.
    Given the ``model``, the pairs of ``target_parameters`` are keyed by the
    parameter's full name (:func:`lora_targets`), and a fused experts tensor's
    rank is per expert (``A [r·E, in]``), as PEFT counts it.
    """
    check_lora_config(name, config)
    check_lora_keys(name, state_dict)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        match = _KEY.match(key)
        assert match is not None  # checked above
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise ConfigurationError(f"adapter {name!r} has no LoRA weights")
    tensors, scaling = {}, {}
    alpha, alpha_pattern = config_option(config, "lora_alpha", 8), config_option(config, "alpha_pattern", {})
    rslora = bool(config_option(config, "use_rslora", False))
    targets = lora_targets(model, config, parts) if model is not None else {module: module for module in parts}
    for module, pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise ConfigurationError(f"adapter {name!r}: {module} has lora_{next(iter(pair))} but not its partner")
        target = targets[module]
        rank = (
            pair["A"].shape[0] // _experts(model, target)
            if model is not None and target != module
            else pair["A"].shape[0]
        )
        module_alpha = pattern_value(alpha_pattern, target, alpha)
        tensors[target] = (pair["A"], pair["B"])
        scaling[target] = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
    return tensors, scaling


def _experts(model: torch.nn.Module, parameter: str) -> int:
    """How many experts a LoRA pair on ``parameter`` spans (1 unless it is a fused ``[E, out, in]`` tensor)."""
    weight = model.get_parameter(parameter)
    return int(weight.shape[0]) if weight.dim() == 3 else 1


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


def parameter_keys(model: torch.nn.Module, target_parameters: Iterable[str]) -> dict[str, str]:
    """PEFT's state-dict module name for each parameter ``target_parameters`` selects, to the parameter's full name.

    PEFT wraps one module once per targeted parameter, in the order the module
    defines them, the first innermost: with both of a MoE layer's expert
    tensors targeted, ``gate_up_proj``'s pair is saved under
    ``...experts.base_layer.lora_A`` and ``down_proj``'s under ``...experts.lora_A``.
    A target matches a parameter's full name or a dotted suffix of it.
    """
    targets = set(target_parameters)
    keys: dict[str, str] = {}
    for module_name, module in model.named_modules():
        full_names = [(param, f"{module_name}.{param}") for param, _ in module.named_parameters(recurse=False)]
        chosen = [param for param, full in full_names if any(full == t or full.endswith(f".{t}") for t in targets)]
        for depth, param in enumerate(chosen):
            keys[module_name + ".base_layer" * (len(chosen) - 1 - depth)] = f"{module_name}.{param}"
    return keys


def lora_targets(model: torch.nn.Module, config: Any, modules: Iterable[str]) -> dict[str, str]:
    """Each module name of a PEFT state dict (:func:`split_lora_state_dict`'s keys) to what it adapts in ``model``.

    A linear layer is named as itself; a parameter of ``config``'s
    ``target_parameters`` by its full name (see :func:`parameter_keys`).
    """
    keys = parameter_keys(model, config_option(config, "target_parameters", ()) or ())
    return {module: keys.get(module, module) for module in modules}
