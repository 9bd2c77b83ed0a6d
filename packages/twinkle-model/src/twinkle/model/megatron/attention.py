"""Core attention for megatron-core's layers on any device: rotary embedding, then scaled-dot-product attention.

megatron-core's local ``DotProductAttention`` keeps its scores in a CUDA buffer and its
``RotaryEmbedding`` moves its table to CUDA, so the layer spec takes this module instead (with the model's
``position_embedding_type='none'``). It rotates queries and keys (after the layer's QK-norm, as the
Qwen3 family does) by the rows' position ids, which restart inside packed rows, in transformers'
rotate-half convention, and attends with ``scaled_dot_product_attention`` under the block's boolean mask
(``True``: masked). The decoder sets the batch's position ids on the shared :class:`RowPositions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class RowPositions:
    """The current batch's ``[B, S]`` position ids, shared by every layer's attention."""

    position_ids_BS: torch.Tensor | None = None


class RotaryAttention(nn.Module):
    """``softmax(rope(q) rope(k)ᵀ / √d + mask) v`` over megatron's ``[S, B, heads, d]`` tensors (grouped K/V)."""

    def __init__(self, *, positions: RowPositions, rope_theta: float, config: Any, **_: Any) -> None:
        super().__init__()
        self.positions = positions
        self.rope_theta = rope_theta
        self.softmax_scale = config.softmax_scale

    def forward(
        self,
        query_SBNH: torch.Tensor,
        key_SBGH: torch.Tensor,
        value_SBGH: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *_: Any,
        **__: Any,
    ) -> torch.Tensor:
        length, rows, dim = query_SBNH.shape[0], query_SBNH.shape[1], query_SBNH.shape[-1]
        position_ids = self.positions.position_ids_BS
        if position_ids is None:
            position_ids = torch.arange(length, device=query_SBNH.device).expand(rows, length)
        cos, sin = self._rotation(position_ids, dim, query_SBNH.dtype)
        q = _rotate(query_SBNH.permute(1, 2, 0, 3), cos, sin)  # [B, heads, S, d]
        k = _rotate(key_SBGH.permute(1, 2, 0, 3), cos, sin)
        v = value_SBGH.permute(1, 2, 0, 3)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        keep = None if attention_mask is None else ~attention_mask
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(length, rows, -1)

    def _rotation(self, position_ids_BS: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids_BS.device) / dim
        inverse_frequencies = 1.0 / (self.rope_theta**exponents)
        angles_BSD = position_ids_BS.float()[..., None] * inverse_frequencies
        angles_BSD = torch.cat([angles_BSD, angles_BSD], dim=-1)[:, None]  # [B, 1, S, d]
        return angles_BSD.cos().to(dtype), angles_BSD.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
