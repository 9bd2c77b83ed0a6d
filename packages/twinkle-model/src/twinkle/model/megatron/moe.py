"""A Qwen3-MoE feed-forward block in megatron-core's layer spec, on any device.

megatron-core's own ``MoELayer`` moves its router to CUDA unconditionally, so a MoE layer's ``mlp`` is
this module: transformers' computation (softmax router in float32, top-k, optional renormalisation;
each chosen expert's SwiGLU weighted by its routing weight), with the experts' weights fused as
transformers fuses them (``gate_up [E, 2·I, H]``, ``down [E, H, I]``) and cut over the tensor-parallel
group as megatron cuts a dense MLP: ``gate_up`` by rows of both halves, ``down`` by columns. Each rank
computes its part of every expert's output; the parts are summed over the group. The router is
replicated, and its gradient (a partial one per rank, like the input's) is summed over the group. A forward
that asks for the router's logits (the load-balancing loss, ``output_router_logits``) finds each layer's in
its :class:`RouterLogits`; every tensor-parallel rank computes that loss whole, so its gradient is divided by
the group's size on the way back (the group sums it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from twinkle.model.megatron.collectives import copy_to_group, scale_gradient, sum_over_group
from twinkle.model.megatron.conversion import num_experts
from twinkle.model.parallel.experts import ExpertAdapters, swiglu_expert


class RouterLogits:
    """Every MoE layer's router logits ``[S·B, E]`` of the current forward, in layer order, while recording."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] | None = None  # None: not recording


class FusedExperts(nn.Module):
    """A layer's experts as transformers fuses them (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), this
    rank's tensor-parallel part of each; called as transformers calls its experts module, so expert parallelism
    (:class:`twinkle.model.parallel.experts.ExpertShard`) can take its place, adapters included."""

    def __init__(self, experts: int, hidden: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.act_fn = nn.functional.silu
        self.adapters: ExpertAdapters | None = None  # the layer's LoRA pairs on the experts (set by the model)
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * width, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, width, dtype=dtype))
        for param, dim, stride in ((self.gate_up_proj, 1, 2), (self.down_proj, 2, 1)):
            param.tensor_model_parallel = True  # type: ignore[attr-defined]
            param.partition_dim, param.partition_stride = dim, stride  # type: ignore[attr-defined]

    def forward(self, x_NH: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        tags_N = None if self.adapters is None else self.adapters.token_tags(x_NH.shape[0])
        out_NH = torch.zeros_like(x_NH)
        for expert in experts_NK.unique().tolist():
            tokens, slot = torch.where(experts_NK == expert)
            expert_out = swiglu_expert(self, expert, x_NH[tokens], None if tags_N is None else tags_N[tokens])
            out_NH = out_NH.index_add(0, tokens, expert_out * weights_NK[tokens, slot, None])
        return out_NH


class MegatronMoE(nn.Module):
    """Top-k routed SwiGLU experts; ``forward`` takes and returns megatron's ``[S, B, H]`` (with no bias)."""

    def __init__(
        self,
        config: Any,  # megatron's TransformerConfig (the spec builds modules with it)
        hf_config: Any,
        group: dist.ProcessGroup | None,
        rank: int,
        size: int,
        router_logits: RouterLogits,
        **_: Any,  # what megatron passes an MLP (tp_group, pg_collection): the group above is ours
    ) -> None:
        super().__init__()
        self.group, self.size = group, size
        self.router_logits = router_logits
        experts, hidden = num_experts(hf_config), hf_config.hidden_size
        self.top_k, self.normalize = hf_config.num_experts_per_tok, hf_config.norm_topk_prob
        dtype = config.params_dtype
        self.router = nn.Parameter(torch.zeros(experts, hidden, dtype=dtype))
        self.router.partial_over_tensor_parallel = True  # type: ignore[attr-defined]
        self.experts = FusedExperts(experts, hidden, hf_config.moe_intermediate_size // size, dtype)
        self.adapters: ExpertAdapters | None = None  # the layer's LoRA pairs, the router's among them

    def forward(self, hidden_SBH: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
        shape = hidden_SBH.shape
        x_NH = copy_to_group(hidden_SBH.reshape(-1, shape[-1]), self.group, self.size)
        logits_NE = nn.functional.linear(x_NH, self.router)
        adapters = self.adapters
        tags_N = None if adapters is None else adapters.token_tags(x_NH.shape[0])
        update = None if adapters is None or tags_N is None else adapters.update("router", 0, x_NH, tags_N)
        logits_NE = logits_NE if update is None else logits_NE + update
        if self.router_logits.logits is not None:
            # Every tensor-parallel rank computes the same load-balancing loss from these, but the router's and
            # the input's gradients are summed over the group (each rank's experts' part): count it once.
            self.router_logits.logits.append(scale_gradient(logits_NE, 1 / self.size))
        probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float)
        weights_NK, experts_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.normalize:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        out_NH = self.experts(x_NH, experts_NK, weights_NK.to(logits_NE.dtype))
        return sum_over_group(out_NH, self.group, self.size).view(shape), None
