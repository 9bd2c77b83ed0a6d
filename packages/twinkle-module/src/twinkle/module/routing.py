"""Recording and replaying a MoE model's routing: which experts each token's router chose, in every layer.

In RL the sampler and the trainer run the same tokens through the same
weights, but not through the same kernels (batch shapes, precision, fused
ops): a router logit near a tie can pick different experts on the two sides,
and the token's log-prob then differs by far more than round-off, which the
policy-ratio losses read as off-policy drift. Router replay removes that
cause: the sampler records every token's experts (:func:`record_routing`) and
the trainer's forward routes each token to them (:func:`replay_routing`),
keeping the router's own probabilities as the experts' weights, so gradients
still reach the router.

Both work on transformers' softmax top-k routers (Qwen2/3-MoE's
``*TopKRouter``: ``(logits, weights, experts)`` from ``softmax → top-k →
renormalise``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from twinkle.data_format import FREE_EXPERT
from twinkle.errors import InvalidInputError


def topk_routers(model: torch.nn.Module) -> list[Any]:  # transformers' router modules
    """Every MoE layer's softmax top-k router in ``model``, in layer order (PEFT-wrapped ones by their inner module)."""
    return [
        module
        for module in model.modules()
        if all(hasattr(module, name) for name in ("top_k", "num_experts", "norm_topk_prob"))
        and not hasattr(module, "base_layer")
    ]


class RoutingRecord:
    """The experts each router chose in the forwards since the last :meth:`take`."""

    def __init__(self, layers: int) -> None:
        self._chosen: list[list[torch.Tensor]] = [[] for _ in range(layers)]

    def add(self, layer: int, experts_NK: torch.Tensor) -> None:
        self._chosen[layer].append(experts_NK.detach())

    def take(self) -> torch.Tensor:
        """``[N, layers, top_k]`` for the tokens of the forward(s) since the last take, and forget them."""
        per_layer = [torch.cat(chosen) for chosen in self._chosen]
        self._chosen = [[] for _ in self._chosen]
        return torch.stack(per_layer, dim=1)


@contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[RoutingRecord | None]:
    """Within the block, every router forward of ``model`` adds its tokens' experts to the record (``None``: no MoE)."""
    routers = topk_routers(model)
    if not routers:
        yield None
        return
    record = RoutingRecord(len(routers))
    handles = [
        router.register_forward_hook(lambda _m, _i, output, layer=layer: record.add(layer, output[2]))
        for layer, router in enumerate(routers)
    ]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def replay_routing(model: torch.nn.Module, routed_BTLK: torch.Tensor | None) -> Iterator[None]:
    """Within the block, route every token of ``model``'s forwards on a ``[B, T]`` batch to ``routed_BTLK``'s experts.

    A token whose record is ``FREE_EXPERT`` (-1) keeps its router's choice. Backward (activation checkpointing's
    recomputation included) must run inside the block too. ``None``: nothing is replayed.
    """
    if routed_BTLK is None:
        yield
        return
    routers = topk_routers(model)
    _check(routed_BTLK, routers)
    per_layer_NK = [routed_BTLK[:, :, layer].reshape(-1, routed_BTLK.shape[3]) for layer in range(len(routers))]
    handles = [
        router.register_forward_hook(lambda module, _i, output, recorded=recorded: _replayed(module, output, recorded))
        for router, recorded in zip(routers, per_layer_NK, strict=True)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check(routed_BTLK: torch.Tensor, routers: list[Any]) -> None:
    layers, top_k = routed_BTLK.shape[2:]
    if not routers:
        raise InvalidInputError("routed_experts was given, but the model has no softmax top-k MoE router to replay")
    if layers != len(routers) or top_k != routers[0].top_k:
        raise InvalidInputError(
            f"routed_experts records {layers} layer(s) x top-{top_k}; the model has {len(routers)} MoE layer(s) "
            f"x top-{routers[0].top_k}"
        )
    experts = int(routers[0].num_experts)
    if int(routed_BTLK.max()) >= experts:
        raise InvalidInputError(f"routed_experts holds expert id {int(routed_BTLK.max())}; the model has {experts}")


def _replayed(router: Any, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor], recorded_NK: torch.Tensor) -> Any:
    logits_NE, _, chosen_NK = output
    if recorded_NK.shape[0] != chosen_NK.shape[0]:
        raise InvalidInputError(
            f"routed_experts covers {recorded_NK.shape[0]} tokens, the forward routes {chosen_NK.shape[0]}"
        )
    recorded_NK = recorded_NK.to(chosen_NK.device)
    free_N = (recorded_NK == FREE_EXPERT).any(dim=-1, keepdim=True)
    experts_NK = torch.where(free_N, chosen_NK, recorded_NK)
    # The router's own weights for those experts, as it computes them for its choice.
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float)
    weights_NK = probs_NE.gather(-1, experts_NK)
    if router.norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return logits_NE, weights_NK.to(logits_NE.dtype), experts_NK
