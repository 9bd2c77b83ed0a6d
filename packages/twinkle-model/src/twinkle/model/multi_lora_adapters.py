"""LoRA adapters as plain parameters served by ``MultiLoraLinear`` layers (no PEFT wrapping).

Each adapter is described by a ``peft.LoraConfig`` (rank, alpha, target
modules, dropout, ``rank_pattern``/``alpha_pattern``, rsLoRA) and owns one
``(A, B)`` parameter pair per targeted linear layer. Target modules resolve
exactly as PEFT resolves them, and the state dict uses PEFT's keys, so a saved
adapter loads in plain ``peft`` and a PEFT adapter loads here.

Parameters may be targets too (PEFT's ``target_parameters``, which its
``"all-linear"`` fills in on transformers' MoE families): a MoE layer's fused
experts get one pair per expert, its router weight one pair, served per row by
``MultiLoraExperts`` / ``MultiLoraRouter``; they are named by the parameter's
full name here and by PEFT's nested module names in saved files.

The output layer (``lm_head``) may be a target, as in PEFT. When the model
ties it to the input embedding, the adapter changes the output projection
only: the shared weight stays frozen and the embedding lookup never sees the
LoRA update, which is what PEFT computes for a tied ``lm_head`` target
(without ``ensure_weight_tying``, which would adapt the embedding too).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig, PeftConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
from torch import nn

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.module import (
    ExpertLora,
    MultiLoraLinear,
    check_lora_config,
    inject_multi_lora,
    parameter_keys,
    parameter_lora_layer,
    pattern_value,
    set_adapter_weights,
    split_lora_state_dict,
)

# LoraConfig options that change what a plain ``dropout(x) @ A.T @ B.T * scaling`` computes or where it applies.
_UNSUPPORTED = {
    "layers_to_transform": "layers_to_transform",
    "layer_replication": "layer_replication",
    "use_qalora": "QA-LoRA",
    "ensure_weight_tying": "ensure_weight_tying (LoRA on the tied input embedding too)",
}
_INITIALISATIONS = (True, "gaussian")


@dataclass
class MultiLoraAdapter:
    """One adapter's config and its trainable ``(A, B)`` pair per target (module or parameter name).

    ``peft_names`` gives a targeted parameter's name in PEFT's files (its
    nested module name); a linear layer's is its own.
    """

    config: LoraConfig
    weights: dict[str, tuple[nn.Parameter, nn.Parameter]]
    scaling: dict[str, float]
    peft_names: dict[str, str]

    def parameters(self) -> list[nn.Parameter]:
        return [tensor for pair in self.weights.values() for tensor in pair]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT-format tensors (views of the parameters: nothing is copied)."""
        return {
            f"base_model.model.{self.peft_names.get(target, target)}.lora_{part}.weight": tensor
            for target, (A, B) in self.weights.items()
            for part, tensor in (("A", A), ("B", B))
        }

    def delta_weight(self, target: str, weight: torch.Tensor) -> torch.Tensor:
        """The update this adapter adds to ``target``'s ``weight`` (fused experts: one per expert)."""
        A, B = self.weights[target]
        if weight.dim() == 3:
            return ExpertLora.from_peft(A, B, weight.shape[0], self.scaling[target]).delta_weight()
        return self.scaling[target] * (B @ A)

    def load_state_dict(self, name: str, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy PEFT-format tensors into the parameters; all are checked before any is changed."""
        targets = {peft_name: target for target, peft_name in self.peft_names.items()}
        tensors = {
            targets.get(m, m): pair for m, pair in split_lora_state_dict(name, self.config, state_dict)[0].items()
        }
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
    config = as_peft_resolves(model, check_config(name, config))
    peft_names = {target: key for key, target in parameter_keys(model, config.target_parameters or ()).items()}
    targets = target_module_names(model, config) + list(peft_names)
    base = model.get_input_embeddings().weight
    weights, scaling = {}, {}
    for target in targets:
        rank = int(pattern_value(config.rank_pattern or {}, target, config.r))
        alpha = float(pattern_value(config.alpha_pattern or {}, target, config.lora_alpha))
        if rank < 1 or rank > max_rank:
            raise ConfigurationError(f"adapter {name!r}: rank {rank} of {target} is outside 1..{max_rank}")
        experts, out_features, in_features = _lora_shape(model, target)
        A = torch.empty(rank * experts, in_features, device=base.device, dtype=base.dtype)
        B = torch.zeros(out_features, rank * experts, device=base.device, dtype=base.dtype)
        if config.init_lora_weights == "gaussian":
            nn.init.normal_(A, std=1 / rank)
        else:
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))
        weights[target] = (nn.Parameter(A), nn.Parameter(B))
        scaling[target] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    inject_multi_lora(model, targets)
    set_adapter_weights(model, name, weights, scaling, dropout=config.lora_dropout)
    return MultiLoraAdapter(config, weights, scaling, peft_names)


def _lora_shape(model: Any, target: str) -> tuple[int, int, int]:
    """``(experts, out_features, in_features)`` of a targeted linear layer (1 expert) or parameter."""
    module = model.get_submodule(target) if target in dict(model.named_modules()) else None
    if module is not None:
        return 1, module.out_features, module.in_features
    owner, _, param = target.rpartition(".")
    parameter_lora_layer(model.get_submodule(owner), param)  # refuses what no layer can adapt, by name
    weight = model.get_parameter(target)
    return (1, *weight.shape) if weight.dim() == 2 else tuple(weight.shape)


def as_peft_resolves(model: Any, config: LoraConfig) -> LoraConfig:
    """``config`` as PEFT turns it for this model: on transformers' MoE families ``"all-linear"`` (or the
    v4 expert names) also targets the fused experts and the router, a fused ``gate_up_proj`` with twice
    the rank and alpha. Saved, the result loads in PEFT with the same targets."""
    converted = copy.deepcopy(config)
    try:
        convert_peft_config_for_transformers(converted, model=model, conversions=None)
    except ValueError as exc:  # e.g. gate_proj without up_proj, which the MoE layers fuse into one tensor
        raise ConfigurationError(f"cannot adapt {type(model).__name__} with this LoraConfig: {exc}") from exc
    if not converted.target_parameters:
        return config
    resolved = copy.deepcopy(config)
    resolved.target_parameters = sorted(converted.target_parameters)
    resolved.rank_pattern, resolved.alpha_pattern = converted.rank_pattern, converted.alpha_pattern
    if isinstance(config.target_modules, str) and isinstance(converted.target_modules, set):
        # PEFT resolved the string over nn.Linear layers; those already MultiLoraLinear (another adapter's
        # targets) it could not see, and keeps as it keeps their kind.
        names = target_module_names(model, config)
        injected = {name.rsplit(".", 1)[-1] for name in names if isinstance(model.get_submodule(name), MultiLoraLinear)}
        resolved.target_modules = sorted(converted.target_modules | injected)
    else:
        resolved.target_modules = converted.target_modules
    return resolved


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
    if not names and not config.target_parameters:
        raise ConfigurationError(f"target_modules {targets!r} match no linear layer of {type(model).__name__}")
    return names
