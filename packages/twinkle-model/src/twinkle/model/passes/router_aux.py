"""The MoE router's auxiliary load-balancing loss, per request, when the model's config asks for it.

transformers' MoE families add ``router_aux_loss_coef × aux`` to the loss when
``config.output_router_logits`` is set (``TransformersModel(model_id,
output_router_logits=True)``). ``aux`` is Switch Transformer's load-balancing
loss: ``E · Σ_e f_e · p_e`` over the router's decisions in every layer, with
``f_e`` the fraction of top-k assignments that go to expert ``e`` and ``p_e``
its mean routing probability. In a shared pass each request's is computed on
its own rows' tokens (padding excluded), so one tenant's batch never balances
another's experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RouterAux:
    """How a model's router loss is computed: its experts, top-k and weight in the loss."""

    num_experts: int
    top_k: int
    coef: float

    def loss(self, router_logits: Sequence[torch.Tensor], tokens_BT: torch.Tensor) -> torch.Tensor:
        """``aux`` over the tokens ``tokens_BT`` selects (bool ``[B, T]``) of every layer's ``[B, T, E]`` logits."""
        dtype = torch.promote_types(router_logits[0].dtype, torch.float32)  # at least float32, as transformers
        assigned_E = tokens_BT.new_zeros(self.num_experts, dtype=dtype)
        probability_E = tokens_BT.new_zeros(self.num_experts, dtype=dtype)
        count = 0
        for logits_BTE in router_logits:
            probs_NE = torch.softmax(logits_BTE[tokens_BT].to(dtype), dim=-1)
            chosen_NK = torch.topk(probs_NE, self.top_k, dim=-1).indices
            assigned_E = assigned_E + torch.bincount(chosen_NK.reshape(-1), minlength=self.num_experts).to(dtype)
            probability_E = probability_E + probs_NE.sum(0)
            count += probs_NE.shape[0]
        if not count:
            return probability_E.sum()  # no token: zero, still in the graph
        return self.num_experts * torch.sum((assigned_E / count) * (probability_E / count))


def router_aux_for(model: Any) -> RouterAux | None:
    """The router loss ``model`` (a transformers causal LM) computes; ``None`` unless its config turns it on."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not getattr(config, "output_router_logits", False) or not experts:
        return None
    return RouterAux(int(experts), int(config.num_experts_per_tok), float(config.router_aux_loss_coef))
