"""Ulysses sequence parallelism: the ranks of a group split a batch's tokens and exchange attention heads.

Each of the ``n`` ranks of a group (``DeviceMesh.ulysses_size``) runs the
decoder on its contiguous ``1/n`` of every row's tokens (rows padded to a
multiple of ``n``). Everything in a decoder layer but attention is per token.
Attention exchanges with one all-to-all: each rank gets every token of ``1/n``
of the heads, attends over the whole sequence with the batch's full mask
(padding, packed sequences), and a second all-to-all brings its own tokens'
heads back. So a rank keeps ``1/n`` of the activations, which is what lets
long sequences fit. The last hidden states are gathered, so the output layer,
the loss and the metrics see the whole batch on every rank of the group, as
one process would.

Gradients: each all-to-all back-propagates as the reverse all-to-all, and the
gather as its adjoint (the ranks' gradients summed, each keeping its own
tokens'). Every rank of a group computes the same loss, so the group's
gradients add up to ``n`` times that loss's; ``Parallelism.gradient_share``
scales by the number of groups, not of ranks, which makes up for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from twinkle.errors import ConfigurationError
from twinkle.infra import DeviceMesh
from twinkle.model.parallel.tensors import own_group

ATTENTION = "twinkle_ulysses"  # the attention implementation a sequence-parallel model runs with


@dataclass(frozen=True)
class Exchange:
    """What a layer's attention needs beyond its own tokens: the group, and the whole batch's mask."""

    group: dist.ProcessGroup
    size: int
    mask_B1TT: torch.Tensor | None  # True: may attend; None: causal within every (unpadded, unpacked) row


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, exchange: Exchange) -> torch.Tensor:
        ctx.dims, ctx.exchange = (scatter_dim, gather_dim), exchange
        return _all_to_all(x, scatter_dim, gather_dim, exchange)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.exchange), None, None, None


def exchange_heads(x: torch.Tensor, scatter_dim: int, gather_dim: int, exchange: Exchange) -> torch.Tensor:
    """:func:`_all_to_all` with autograd: the gradient goes back by the reverse exchange."""
    output: torch.Tensor = _AllToAll.apply(x, scatter_dim, gather_dim, exchange)  # type: ignore[no-untyped-call]
    return output


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, exchange: Exchange) -> torch.Tensor:
    """Part ``i`` of ``x`` along ``scatter_dim`` goes to group rank ``i``; the parts received join on ``gather_dim``."""
    inputs = [part.contiguous() for part in x.chunk(exchange.size, dim=scatter_dim)]
    outputs = [torch.empty_like(part) for part in inputs]
    dist.all_to_all(outputs, inputs, group=exchange.group)
    return torch.cat(outputs, dim=gather_dim)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_BTH: torch.Tensor, exchange: Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        parts = [torch.empty_like(x_BTH) for _ in range(exchange.size)]
        dist.all_gather(parts, x_BTH.contiguous(), group=exchange.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad_BTH: torch.Tensor) -> tuple[torch.Tensor, None]:
        exchange = ctx.exchange
        grad_BTH = grad_BTH.contiguous()
        dist.all_reduce(grad_BTH, group=exchange.group)  # every rank's loss reads every rank's tokens
        own = grad_BTH.chunk(exchange.size, dim=1)[dist.get_rank(exchange.group)]
        return own.contiguous(), None


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    twinkle_ulysses: Exchange | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: this rank's tokens' ``[B, heads, T/n, D]`` in, ``[B, T/n, heads, D]`` out.

    A forward that is not split (``generate``: no ``twinkle_ulysses`` exchange) is plain SDPA attention.
    """
    exchange = twinkle_ulysses
    if exchange is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ConfigurationError("sequence parallelism does not support sliding-window attention layers")
    # [B, heads, T/n, D] -> [B, heads/n, T, D]: every token of this rank's share of the heads.
    query, key, value = (exchange_heads(x, 1, 2, exchange) for x in (query, key, value))
    output_BThD, _ = sdpa_attention_forward(
        module, query, key, value, exchange.mask_B1TT, dropout=dropout, scaling=scaling, is_causal=True, **kwargs
    )
    return exchange_heads(output_BThD, 1, 2, exchange), None  # [B, T, heads/n, D] -> [B, T/n, heads, D]


class SequenceParallel:
    """This rank's Ulysses group: builds the groups (every rank, in the same order) and runs the split decoder."""

    def __init__(self, mesh: DeviceMesh, rank: int) -> None:
        self.size = mesh.ulysses_size
        self.rank_in_group = mesh.ulysses_rank(rank)
        self.group = own_group(mesh.ulysses_groups(), rank)
        self.is_leader = self.rank_in_group == 0

    def prepare(self, model: Any) -> None:
        """Check that ``model``'s attention splits over the group, and switch it to the Ulysses attention."""
        config = model.config
        heads = int(getattr(config, "num_attention_heads", 0))
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        if not heads or heads % self.size or kv_heads % self.size:
            raise ConfigurationError(
                f"ulysses_size={self.size} must divide the model's attention heads (num_attention_heads={heads}, "
                f"num_key_value_heads={kv_heads}): each rank attends with 1/{self.size} of them"
            )
        AttentionInterface.register(ATTENTION, ulysses_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # the masks of forwards that are not split
        model.set_attn_implementation(ATTENTION)
        if model.config._attn_implementation != ATTENTION:
            raise ConfigurationError(
                f"{type(model).__name__} does not take transformers' pluggable attention functions, "
                "which sequence parallelism needs"
            )

    def decode(
        self, decoder: torch.nn.Module, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The decoder's last hidden states ``[B, T, H]`` on ``inputs`` (a causal-LM forward's), computed split.

        With ``output_router_logits`` in ``inputs``, every MoE layer's router logits ``[B, T, E]`` too.
        """
        input_ids_BT: torch.Tensor = inputs["input_ids"]
        rows, length = input_ids_BT.shape
        padded = self._padded(length)
        # The decoder makes its own (local) mask too, for forwards that are not split; the exchange's replaces it.
        position_ids_BT, attention_mask_BT = _pad(inputs["position_ids"], inputs.get("attention_mask"), padded)
        exchange = Exchange(self.group, self.size, _full_mask(position_ids_BT, attention_mask_BT))
        own_ids_BT = self.own_tokens(input_ids_BT, 0)
        router = {"output_router_logits": True} if inputs.get("output_router_logits") else {}
        own_positions_BT = self._share(position_ids_BT)
        output = decoder(
            input_ids=own_ids_BT, position_ids=own_positions_BT, use_cache=False, twinkle_ulysses=exchange, **router
        )
        hidden_BTH = _gather_tokens(output.last_hidden_state, exchange)[:, :length]
        if not router:
            return hidden_BTH, None
        router_logits = [
            _gather_tokens(logits.view(rows, padded // self.size, -1), exchange)[:, :length]
            for logits in output.router_logits
        ]
        return hidden_BTH, router_logits

    def own_tokens(self, x_BT: torch.Tensor, fill: int) -> torch.Tensor:
        """This rank's share of a per-token ``[B, T, ...]`` tensor, rows lengthened with ``fill`` like the decoder's."""
        extra = self._padded(x_BT.shape[1]) - x_BT.shape[1]
        if extra:
            x_BT = torch.cat([x_BT, x_BT.new_full((x_BT.shape[0], extra, *x_BT.shape[2:]), fill)], dim=1)
        return self._share(x_BT)

    def _padded(self, length: int) -> int:
        return -(-length // self.size) * self.size

    def _share(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous ``1/n`` of a tensor whose rows are already padded to a multiple of ``n``."""
        width = x_BT.shape[1] // self.size
        return x_BT[:, self.rank_in_group * width : (self.rank_in_group + 1) * width]


def _gather_tokens(x_BTH: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Every rank's tokens of ``x_BTH``, in order, with the gather's adjoint for backward."""
    gathered_BTH: torch.Tensor = _GatherTokens.apply(x_BTH, exchange)  # type: ignore[no-untyped-call]
    return gathered_BTH


def _pad(
    position_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None, length: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows lengthened to ``length``: masked out, or (unmasked) continuing the last sequence, after its tokens."""
    extra = length - position_ids_BT.shape[1]
    if not extra:
        return position_ids_BT, attention_mask_BT
    steps = torch.arange(1, extra + 1, device=position_ids_BT.device)
    position_ids_BT = torch.cat([position_ids_BT, position_ids_BT[:, -1:] + steps], dim=1)
    if attention_mask_BT is not None:
        attention_mask_BT = torch.nn.functional.pad(attention_mask_BT, (0, extra))
    return position_ids_BT, attention_mask_BT


def _full_mask(position_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None) -> torch.Tensor | None:
    """Who may attend to whom in the whole batch, as transformers decides it without sequence parallelism.

    A padded batch: causal, to unmasked keys (a masked query to itself, so no row of the mask is empty).
    Otherwise sequences packed in a row restart their ``position_ids``; each attends causally to itself.
    """
    length = position_ids_BT.shape[1]
    causal_TT = torch.ones(length, length, dtype=torch.bool, device=position_ids_BT.device).tril()
    if attention_mask_BT is not None:
        mask_BTT = causal_TT & attention_mask_BT.bool()[:, None, :]
        return (mask_BTT | torch.eye(length, dtype=torch.bool, device=mask_BTT.device))[:, None]
    starts_BT = torch.diff(position_ids_BT, prepend=position_ids_BT[:, :1] - 1, dim=-1) != 1
    if not starts_BT[:, 1:].any():
        return None  # one sequence per row
    segment_BT = starts_BT.cumsum(-1)
    return (causal_TT & (segment_BT[:, :, None] == segment_BT[:, None, :]))[:, None]
