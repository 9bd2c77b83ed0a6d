"""LoRA on a MoE layer's parameters (PEFT's ``target_parameters``): fused experts and router.

PEFT adapts a fused expert tensor ``[E, out, in]`` with one pair for all experts: ``lora_A [r·E, in]``
(experts major) and ``lora_B [out, r·E]`` (experts minor), and names it by the module holding the tensor:
with both ``gate_up_proj`` and ``down_proj`` targeted, ``gate_up_proj``'s pair is saved under
``...mlp.experts.base_layer`` and ``down_proj``'s under ``...mlp.experts`` (one ``base_layer`` per wrapper
inside). The router's ``[E, H]`` weight (``mlp.gate.weight``) takes an ordinary pair under ``...mlp.gate``.
Over the tensor-parallel group the pairs are cut as the experts are: ``gate_up_proj``'s ``B`` by rows
(both halves), its ``A`` whole with partial gradients; ``down_proj``'s ``A`` by columns, its ``B`` whole
with partial gradients (each rank's output is a part, summed after the experts); the router's pair is
whole with partial gradients, as the router is.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from twinkle.model.parallel.experts import ExpertSlice
from twinkle.module import ExpertLora, pattern_value

# A MoE layer's adaptable parameters: our name for each -> (the transformers module holding it, its name there),
# each module's in the order PEFT wraps them (the first innermost).
LAYER_PARAMETERS = {
    "gate_up_proj": ("mlp.experts", "gate_up_proj"),
    "down_proj": ("mlp.experts", "down_proj"),
    "router": ("mlp.gate", "weight"),
}


def expert_targets(config: Any, num_layers: int) -> list[tuple[int, str, str]]:
    """``(layer, parameter, PEFT module name)`` for every MoE parameter ``config.target_parameters`` selects."""
    targets = list(getattr(config, "target_parameters", None) or ())
    chosen = []
    for layer in range(num_layers):
        for owner in dict.fromkeys(module for module, _ in LAYER_PARAMETERS.values()):
            prefix = f"model.layers.{layer}.{owner}"
            picked = [
                name
                for name, (module, param) in LAYER_PARAMETERS.items()
                if module == owner and any(_selects(t, f"{prefix}.{param}") for t in targets)
            ]
            for depth, name in enumerate(picked):
                chosen.append((layer, name, prefix + ".base_layer" * (len(picked) - 1 - depth)))
    return chosen


def unknown_targets(config: Any, num_layers: int) -> list[str]:
    """The ``target_parameters`` entries that name no MoE parameter of any layer."""
    names = [full_name(layer, name) for layer in range(num_layers) for name in LAYER_PARAMETERS]
    targets = list(getattr(config, "target_parameters", None) or ())
    return [t for t in targets if not any(_selects(t, name) for name in names)]


def full_name(layer: int, name: str) -> str:
    """The transformers name of layer ``layer``'s parameter ``name`` (a key of :data:`LAYER_PARAMETERS`)."""
    module, param = LAYER_PARAMETERS[name]
    return f"model.layers.{layer}.{module}.{param}"


def _selects(target: str, name: str) -> bool:
    """A target names a parameter by its full name or a dotted suffix of it (PEFT's rule)."""
    return name == target or name.endswith(f".{target}")


def initial_A(rows: int, in_features: int, like: torch.Tensor) -> torch.Tensor:
    """PEFT's initial LoRA ``A`` (Kaiming-uniform), drawn on the CPU in float32 and then moved to ``like``'s device
    and dtype, so a seed gives the same adapter on any device and in any dtype (up to rounding)."""
    A = torch.empty(rows, in_features)
    nn.init.kaiming_uniform_(A, a=math.sqrt(5))
    return A.to(device=like.device, dtype=like.dtype)


def expert_pair(
    param: str,
    rank: int,
    experts: int,
    shape: tuple[int, int],
    like: torch.Tensor,
    tensor_part: tuple[int, int],
    expert_block: tuple[int, int],
) -> nn.ParameterDict:
    """PEFT's initial pair for a fused expert tensor of per-expert ``shape`` ``(out, in)`` (or the router's
    ``[E, H]``, one pair: ``experts`` 1), this rank's part: ``tensor_part`` is its ``(rank, size)`` in the
    tensor-parallel group, ``expert_block`` its block of the experts (expert parallelism) and their number."""
    out_features, in_features = shape
    (tp_rank, tp_size), (block, blocks) = tensor_part, expert_block
    A = initial_A(rank * experts, in_features, like)  # the whole matrix on every rank
    B = torch.zeros(out_features, rank * experts, dtype=like.dtype, device=like.device)
    # Which of A and B is cut (by which dimension); the other is whole, with partial gradients.
    cut = {"down_proj": ("A", 1), "gate_up_proj": ("B", 0)}.get(param)
    if tp_size > 1 and cut == ("A", 1):
        A = A.chunk(tp_size, dim=1)[tp_rank].clone()
    elif tp_size > 1 and cut == ("B", 0):  # gate_up: each rank's rows of both halves, as the experts' weights
        halves = B.chunk(2 * tp_size, dim=0)
        B = torch.cat([halves[tp_rank], halves[tp_size + tp_rank]]).clone()
    # This rank's experts' pairs only: A's blocks of rows, B's columns (the expert is B's minor index).
    slices = {part: ExpertSlice(part == "B", experts // blocks, block, blocks) for part in ("A", "B")}
    if blocks > 1:
        A, B = slices["A"].cut(A), slices["B"].cut(B)
    pair = nn.ParameterDict({"A": nn.Parameter(A), "B": nn.Parameter(B)})
    for part in ("A", "B"):
        sharded_dim = cut[1] if cut is not None and cut[0] == part else None
        stride = 2 if param == "gate_up_proj" else 1
        tensor: Any = pair[part]
        tensor.tensor_model_parallel = sharded_dim is not None
        tensor.partition_dim = -1 if sharded_dim is None else sharded_dim
        tensor.partition_stride = stride
        tensor.partial_over_tensor_parallel = sharded_dim is None
        if blocks > 1:  # gradients summed and checkpoints gathered as the experts' own (ExpertParallel)
            tensor.expert_slice = slices[part]
    return pair


def expert_rank(config: Any, layer: int, name: str) -> tuple[int, float]:
    """The pair's rank and alpha (``rank_pattern`` / ``alpha_pattern`` match the parameter's full name)."""
    full = full_name(layer, name)
    rank = int(pattern_value(config.rank_pattern or {}, full, config.r))
    return rank, float(pattern_value(config.alpha_pattern or {}, full, config.lora_alpha))


def expert_update(pair: Any, experts: int, scaling: float, expert: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``expert``'s low-rank update of its rows ``x``: ``x @ A_e.T @ B_e.T · s``."""
    lora = ExpertLora.from_peft(pair["A"], pair["B"], experts, scaling)
    return x @ lora.A_ERI[expert].T @ lora.B_EOR[expert].T * lora.scaling
