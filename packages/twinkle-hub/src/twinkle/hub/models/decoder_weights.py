"""Random weights for a decoder-only transformer, under the key names its Hugging Face checkpoint uses.

Every embedded model draws from one fixed-seed numpy generator in one fixed order (embedding, then each
layer's attention and MLP, then the final norm), so every build writes the same bytes, and torch is not
needed to build. Matrices are N(0, ``INIT_STD``) like transformers' own init, norm scales ones, biases 0.
The embedding rows are larger (``EMBED_STD``): it is tied to the output layer and behind the final RMSNorm
a hidden state has norm ``sqrt(hidden_size)``, so with std 0.02 no logit could leave ~1.3 and even a
perfectly tuned LoRA could not push the loss below ~10.5 nats over 151k tokens.

Families differ in a few places: QK-norm (Qwen3), q/k/v biases (Qwen2, GLM-4), a mixture-of-experts MLP
(Qwen3-MoE: a router and per-expert projections, in the per-expert layout of the Hub checkpoints, which
transformers fuses into 3-D expert tensors when it loads them), and GLM-4's fused gate/up projection and
extra norms after attention and after the MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EMBED_STD", "INIT_STD", "DecoderLayout", "decoder_weights"]

INIT_STD = 0.02
EMBED_STD = 0.25


@dataclass(frozen=True)
class DecoderLayout:
    """What a family's decoder layer holds beyond Llama's."""

    qk_norm: bool = False  # per-head RMSNorm of queries and keys (Qwen3)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    experts: int = 0  # > 0: a mixture-of-experts MLP with this many experts and a router (``mlp.gate``)
    glm: bool = False  # GLM-4: one ``gate_up_proj``, and RMSNorms after attention and after the MLP too


def decoder_weights(config: Any, seed: int, layout: DecoderLayout) -> dict[str, np.ndarray]:
    """Float32 weights for every parameter of ``config``'s model (a transformers config), by checkpoint key."""
    rng = np.random.default_rng(seed)
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = (config.num_key_value_heads or config.num_attention_heads) * head_dim  # None means one per head

    def normal(*shape: int, std: float = INIT_STD) -> np.ndarray:
        values: np.ndarray = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        return values

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    def zeros(size: int) -> np.ndarray:
        return np.zeros(size, dtype=np.float32)

    def mlp(prefix: str, width: int) -> dict[str, np.ndarray]:
        if layout.glm:
            return {
                f"{prefix}.gate_up_proj.weight": normal(2 * width, hidden),
                f"{prefix}.down_proj.weight": normal(hidden, width),
            }
        return {
            f"{prefix}.gate_proj.weight": normal(width, hidden),
            f"{prefix}.up_proj.weight": normal(width, hidden),
            f"{prefix}.down_proj.weight": normal(hidden, width),
        }

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=EMBED_STD)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        attention = f"{prefix}.self_attn"
        weights[f"{prefix}.input_layernorm.weight"] = ones(hidden)
        weights[f"{attention}.q_proj.weight"] = normal(q_width, hidden)
        weights[f"{attention}.k_proj.weight"] = normal(kv_width, hidden)
        weights[f"{attention}.v_proj.weight"] = normal(kv_width, hidden)
        weights[f"{attention}.o_proj.weight"] = normal(hidden, q_width)
        if layout.qkv_bias:
            for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
                weights[f"{attention}.{name}.bias"] = zeros(width)
        if layout.qk_norm:
            weights[f"{attention}.q_norm.weight"] = ones(head_dim)
            weights[f"{attention}.k_norm.weight"] = ones(head_dim)
        weights[f"{prefix}.post_attention_layernorm.weight"] = ones(hidden)
        if layout.glm:
            weights[f"{prefix}.post_self_attn_layernorm.weight"] = ones(hidden)
            weights[f"{prefix}.post_mlp_layernorm.weight"] = ones(hidden)
        if layout.experts:
            weights[f"{prefix}.mlp.gate.weight"] = normal(layout.experts, hidden)
            for expert in range(layout.experts):
                weights.update(mlp(f"{prefix}.mlp.experts.{expert}", config.moe_intermediate_size))
        else:
            weights.update(mlp(f"{prefix}.mlp", config.intermediate_size))
    weights["model.norm.weight"] = ones(hidden)
    return weights
