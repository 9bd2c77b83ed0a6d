"""Expert parallelism: each rank of a group holds ``1/ep`` of every MoE layer's experts; tokens travel to them.

transformers' MoE families (Qwen2/3-MoE, DeepSeek-V2, GLM-4-MoE, Mixtral)
keep a layer's experts as two fused tensors, ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, called with every token's chosen experts and their
weights. :class:`ExpertShard` replaces such a module with rank ``r``'s
contiguous block of experts. Its forward sends every (token, expert) pair to
the rank holding the expert (one all-to-all with uneven splits), runs its
experts on what it receives, sends the results back (the reverse
all-to-all) and adds them up with the router's weights, as the module did.
Each all-to-all back-propagates as the other, so the router and everything
before it get the gradients of the tokens' experts wherever they live.

The experts stay frozen: a LoRA adapter trains the rest (attention, router,
dense layers), and FSDP2 shards it and the rest, leaving the experts alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from twinkle.errors import ConfigurationError
from twinkle.infra import DeviceMesh
from twinkle.model.parallel.tensors import own_group

# Attention and the router, not the experts (PEFT's "all-linear" targets a MoE model's experts too).
_SUGGESTED_CONFIG = (
    "LoraConfig(target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'], target_parameters=['gate.weight'])"
)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, output_counts: list[int], input_counts: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.counts, ctx.group = (output_counts, input_counts), group
        return _all_to_all_rows(rows, output_counts, input_counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_counts, input_counts = ctx.counts
        return _all_to_all_rows(grad, input_counts, output_counts, ctx.group), None, None, None


def _all_to_all_rows(
    rows: torch.Tensor, output_counts: list[int], input_counts: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``input_counts[i]`` consecutive rows go to group rank ``i``; ``output_counts[i]`` come from it."""
    output = rows.new_empty((sum(output_counts), *rows.shape[1:]))
    dist.all_to_all_single(output, rows.contiguous(), output_counts, input_counts, group=group)
    return output


def send_rows(
    rows: torch.Tensor, output_counts: list[int], input_counts: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """:func:`_all_to_all_rows` with autograd (the gradient goes back by the reverse exchange)."""
    output: torch.Tensor = _AllToAllRows.apply(rows, output_counts, input_counts, group)  # type: ignore[no-untyped-call]
    return output


def fused_experts(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every ``(name, module)`` of ``model`` that holds a layer's experts as fused ``[E, ...]`` tensors."""
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if {"gate_up_proj", "down_proj"} <= set(params) and params["gate_up_proj"].dim() == 3:
            yield name, module


class ExpertShard(torch.nn.Module):
    """Experts ``first .. first + count - 1`` of a fused experts module, served to the whole group's tokens."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, experts: Any, rank: int, size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        extra = sorted(set(dict(experts.named_parameters(recurse=False))) - {"gate_up_proj", "down_proj"})
        if extra or getattr(experts, "is_transposed", False):
            raise ConfigurationError(
                f"expert parallelism supports fused experts of gate_up_proj [E, 2I, H] and down_proj [E, H, I] only; "
                f"{type(experts).__name__} also has {extra or 'transposed weights'}"
            )
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.count = self.num_experts // size
        self.first = rank * self.count
        self.size, self.group, self.act_fn = size, group, experts.act_fn
        own = slice(self.first, self.first + self.count)
        self.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data[own].clone(), requires_grad=False)
        self.down_proj = torch.nn.Parameter(experts.down_proj.data[own].clone(), requires_grad=False)

    def forward(self, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor, top_k_weights_NK: torch.Tensor) -> Any:
        experts_A = top_k_index_NK.reshape(-1)  # one (token, expert) assignment per entry
        tokens_A = torch.arange(hidden_NH.shape[0], device=hidden_NH.device).repeat_interleave(top_k_index_NK.shape[1])
        weights_A = top_k_weights_NK.reshape(-1)
        kept = experts_A < self.num_experts  # an index of E is a router's "no expert"
        experts_A, tokens_A, weights_A = experts_A[kept], tokens_A[kept], weights_A[kept]
        owner_A = torch.div(experts_A, self.count, rounding_mode="floor")
        order = torch.argsort(owner_A, stable=True)
        experts_A, tokens_A, weights_A = experts_A[order], tokens_A[order], weights_A[order]
        sent = torch.bincount(owner_A, minlength=self.size)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        input_counts, output_counts = sent.tolist(), received.tolist()
        arrived_expert_R = _all_to_all_rows(experts_A, output_counts, input_counts, self.group) - self.first
        arrived_RH = send_rows(hidden_NH[tokens_A], output_counts, input_counts, self.group)
        computed_RH = self._experts(arrived_RH, arrived_expert_R)
        returned_AH = send_rows(computed_RH, input_counts, output_counts, self.group)
        weighted_AH = returned_AH * weights_A[:, None].to(returned_AH.dtype)
        return torch.zeros_like(hidden_NH).index_add_(0, tokens_A, weighted_AH.to(hidden_NH.dtype))

    def _experts(self, rows_RH: torch.Tensor, experts_R: torch.Tensor) -> torch.Tensor:
        output_RH = rows_RH.new_zeros(rows_RH.shape[0], self.down_proj.shape[1])
        for expert in torch.unique(experts_R).tolist():
            picked = (experts_R == expert).nonzero().squeeze(1)
            gate, up = torch.nn.functional.linear(rows_RH[picked], self.gate_up_proj[expert]).chunk(2, dim=-1)
            output = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            output_RH = output_RH.index_copy(0, picked, output)
        return output_RH


class ExpertParallel:
    """This rank's expert-parallel group: builds the groups (every rank, in the same order) and shards the experts."""

    def __init__(self, mesh: DeviceMesh, rank: int) -> None:
        self.size = mesh.ep_size
        self.rank_in_group = mesh.expert_rank(rank)
        self.group = own_group(mesh.expert_groups(), rank)

    def prepare(self, model: torch.nn.Module) -> None:
        """Replace every fused experts module of ``model`` by this rank's :class:`ExpertShard`."""
        found = list(fused_experts(model))
        if not found:
            raise ConfigurationError(
                f"ep_size={self.size}: {type(model).__name__} has no fused MoE experts to spread over the ranks"
            )
        for name, experts in found:
            total = int(experts.get_parameter("gate_up_proj").shape[0])
            if total % self.size:
                raise ConfigurationError(
                    f"ep_size={self.size} must divide the number of experts per MoE layer ({total}, in {name})"
                )
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, ExpertShard(experts, self.rank_in_group, self.size, self.group))

    def expert_params(self, model: torch.nn.Module) -> set[torch.nn.Parameter]:
        """The experts' parameters (this rank's own), which FSDP must leave alone."""
        return {param for module in model.modules() if isinstance(module, ExpertShard) for param in module.parameters()}

    def check_trainable(self, model: torch.nn.Module, trains_full_model: bool) -> None:
        """Refuse training anything in the experts: each rank holds different ones."""
        if trains_full_model:
            raise ConfigurationError(
                f"full-parameter training under expert parallelism (ep_size={self.size}) is not supported: the "
                f"experts stay frozen; train a LoRA adapter whose targets exclude them, e.g. {_SUGGESTED_CONFIG}"
            )
        roots = [self._root(name) for name, module in model.named_modules() if isinstance(module, ExpertShard)]
        trained = [
            name
            for name, param in model.named_parameters()
            if param.requires_grad and any(name.startswith(f"{root}.") for root in roots)
        ]
        if trained:
            raise ConfigurationError(
                f"under expert parallelism (ep_size={self.size}) the experts stay frozen, but {len(trained)} "
                f"parameter(s) of the adapter are in them (e.g. {trained[0]}); name targets that exclude them "
                f"(PEFT's 'all-linear' adds a MoE model's experts), e.g. {_SUGGESTED_CONFIG}"
            )

    @staticmethod
    def _root(name: str) -> str:
        """The experts' own path, above any adapter layers wrapped around them (PEFT's ``.base_layer``)."""
        while name.endswith(".base_layer"):
            name = name.removesuffix(".base_layer")
        return name
