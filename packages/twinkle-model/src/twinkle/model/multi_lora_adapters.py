"""LoRA adapters as plain parameters served by ``MultiLoraLinear`` layers (no PEFT wrapping).

Each adapter is described by a ``peft.LoraConfig`` (rank, alpha, target
modules, dropout, ``rank_pattern``/``alpha_pattern``, rsLoRA) and owns one
``(A, B)`` parameter pair per targeted linear layer. Target modules resolve
exactly as PEFT resolves them, and the state dict uses PEFT's keys, so a saved
adapter loads in plain ``peft`` and a PEFT adapter loads here.

The output layer (``lm_head``) may be a target, as in PEFT. When the model
ties it to the input embedding, the adapter changes the output projection
only: the shared weight stays frozen and the embedding lookup never sees the
LoRA update, which is what PEFT computes for a tied ``lm_head`` target
(without ``ensure_weight_tying``, which would adapt the embedding too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.module import (
    MultiLoraLinear,
    check_lora_config,
    inject_multi_lora,
    pattern_value,
    set_adapter_weights,
    split_lora_state_dict,
)

# LoraConfig options that change what a plain ``dropout(x) @ A.T @ B.T * scaling`` computes or where it applies.
_UNSUPPORTED = {
    "layers_to_transform": "layers_to_transform",
    "layer_replication": "layer_replication",
    "use_qalora": "QA-LoRA",
    "target_parameters": "target_parameters",
    "ensure_weight_tying": "ensure_weight_tying (LoRA on the tied input embedding too)",
}
_INITIALISATIONS = (True, "gaussian")


@dataclass
class MultiLoraAdapter:
    """One adapter's config and its trainable ``(A_RI, B_OR)`` pair per module name."""

    config: LoraConfig
    weights: dict[str, tuple[nn.Parameter, nn.Parameter]]
    scaling: dict[str, float]

    def parameters(self) -> list[nn.Parameter]:
        return [tensor for pair in self.weights.values() for tensor in pair]

    @property
    def max_rank(self) -> int:
        return max(A_RI.shape[0] for A_RI, _ in self.weights.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT-format tensors (views of the parameters: nothing is copied)."""
        return {
            f"base_model.model.{module}.lora_{part}.weight": tensor
            for module, (A_RI, B_OR) in self.weights.items()
            for part, tensor in (("A", A_RI), ("B", B_OR))
        }

    def load_state_dict(self, name: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy PEFT-format tensors into the parameters; all are checked before any is changed."""
        tensors, _ = split_lora_state_dict(name, self.config, state_dict)
        if set(tensors) != set(self.weights):
            missing, extra = sorted(set(self.weights) - set(tensors)), sorted(set(tensors) - set(self.weights))
            raise ConfigurationError(f"adapter {name!r}: weights missing for {missing[:3]}, unexpected {extra[:3]}")
        for module, (A_RI, B_OR) in tensors.items():
            own_A, own_B = self.weights[module]
            if A_RI.shape != own_A.shape or B_OR.shape != own_B.shape:
                raise ConfigurationError(
                    f"adapter {name!r}: {module} has A {list(A_RI.shape)} and B {list(B_OR.shape)}, "
                    f"expected {list(own_A.shape)} and {list(own_B.shape)}"
                )
        with torch.no_grad():
            for module, (A_RI, B_OR) in tensors.items():
                self.weights[module][0].copy_(A_RI)
                self.weights[module][1].copy_(B_OR)


def create_adapter(model: Any, name: str, config: PeftConfig, max_rank: int) -> MultiLoraAdapter:
    """Make the adapter's parameters (PEFT's initialisation) and install them on ``model``'s layers.

    ``model`` is a transformers model (typed Any: nn.Module's typing does not know ``get_input_embeddings``).
    """
    config = check_config(name, config)
    modules = target_module_names(model, config)
    base = model.get_input_embeddings().weight
    weights, scaling = {}, {}
    for module_name in modules:
        linear = model.get_submodule(module_name)
        rank = int(pattern_value(config.rank_pattern or {}, module_name, config.r))
        alpha = float(pattern_value(config.alpha_pattern or {}, module_name, config.lora_alpha))
        if rank < 1 or rank > max_rank:
            raise ConfigurationError(f"adapter {name!r}: rank {rank} of {module_name} is outside 1..{max_rank}")
        A_RI = torch.empty(rank, linear.in_features, device=base.device, dtype=base.dtype)
        B_OR = torch.zeros(linear.out_features, rank, device=base.device, dtype=base.dtype)
        if config.init_lora_weights == "gaussian":
            nn.init.normal_(A_RI, std=1 / rank)
        else:
            nn.init.kaiming_uniform_(A_RI, a=math.sqrt(5))
        weights[module_name] = (nn.Parameter(A_RI), nn.Parameter(B_OR))
        scaling[module_name] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    inject_multi_lora(model, modules)
    set_adapter_weights(model, name, weights, scaling, dropout=config.lora_dropout)
    return MultiLoraAdapter(config, weights, scaling)


def check_config(name: str, config: PeftConfig) -> LoraConfig:
    """``config`` as a LoraConfig; refuses other adapters and LoRA variants the layer cannot compute, naming them."""
    if not isinstance(config, LoraConfig):
        raise ConfigurationError(f"adapter {name!r}: MultiLoraModel trains LoRA adapters, got {type(config).__name__}")
    check_lora_config(name, config)
    for option, feature in _UNSUPPORTED.items():
        if getattr(config, option, None):
            raise ConfigurationError(f"adapter {name!r} uses {feature}, which MultiLoraModel does not support")
    if config.init_lora_weights not in _INITIALISATIONS:
        raise ConfigurationError(
            f"adapter {name!r}: init_lora_weights={config.init_lora_weights!r} is not supported; use True or 'gaussian'"
        )
    if not 0 <= config.lora_dropout < 1:
        raise InvalidInputError(f"adapter {name!r}: lora_dropout must be in [0, 1), got {config.lora_dropout}")
    return config


def target_module_names(model: Any, config: LoraConfig) -> list[str]:
    """The linear layers ``config`` targets, by PEFT's rules (``'all-linear'`` leaves out the output layer)."""
    output_layer = model.get_output_embeddings()
    linears = [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, MultiLoraLinear))]
    targets = config.target_modules
    if targets is None:  # PEFT's default targets for this architecture
        model_type = getattr(model.config, "model_type", None)
        default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type) if model_type else None
        if default is None:
            raise ConfigurationError(f"no default LoRA targets for model type {model_type!r}: set target_modules")
        config = dataclasses.replace(config, target_modules=list(default))  # LoraConfig makes it a set
        targets = config.target_modules
    if isinstance(targets, str) and targets.lower() == "all-linear":
        names = [name for name in linears if model.get_submodule(name) is not output_layer]
    elif isinstance(targets, (set, list)) and "all-linear" in targets:
        # PEFT would look for a module named "all-linear", so a saved adapter would not load there as trained.
        raise ConfigurationError(
            "'all-linear' is a shorthand only as the whole target_modules string, as in PEFT; to add the "
            "output layer, list the modules (e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', "
            "'up_proj', 'down_proj', 'lm_head'])"
        )
    else:
        names = [name for name in linears if check_target_module_exists(config, name)]
    if not names:
        raise ConfigurationError(f"target_modules {targets!r} match no linear layer of {type(model).__name__}")
    return names
