"""``builtin://qwen3-tiny``: a 10M-parameter Qwen3 causal LM that trains and samples on a CPU.

It is a real Qwen3 architecture (grouped-query attention, q/k RMSNorm, SwiGLU,
tied embeddings) with the real Qwen3 vocabulary and tokenizer, only narrow and
shallow. Code paths exercised on it (LoRA targets, checkpoint key names, chat
templates, token ids) are therefore the ones a real Qwen3 checkpoint takes.

Weights come from a fixed-seed numpy generator, written with ``safetensors.numpy``,
so every build writes the same bytes and torch is not needed to build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import save_file

from twinkle.hub.models.tokenizer import BPE_VOCAB_SIZE, MODEL_MAX_LENGTH, build_tokenizer

if TYPE_CHECKING:
    from transformers import Qwen3Config

WEIGHT_SEED = 20250601
INIT_STD = 0.02
# The embedding is tied to the output layer. Behind the final RMSNorm a hidden state has norm
# sqrt(hidden_size) = 8, so with std 0.02 no logit could exceed ~1.3 and even a perfectly tuned
# LoRA could not push the loss below ~10.5 nats over 151k tokens. Rows of norm ~2 (std 0.25)
# allow confident predictions, so adapters trained on the frozen embedding can actually learn.
EMBED_STD = 0.25

ENDOFTEXT_ID = BPE_VOCAB_SIZE  # <|endoftext|>: document end, padding
IM_END_ID = BPE_VOCAB_SIZE + 2  # <|im_end|>: end of a chat turn
# Real Qwen3 pads its embedding matrix to 151936 rows (a multiple of 128) beyond its 151669 tokens.
PADDED_VOCAB_SIZE = 151936


def tiny_config() -> Qwen3Config:
    """The architecture of ``builtin://qwen3-tiny``: Qwen3's shape rules at toy width and depth."""
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=PADDED_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MODEL_MAX_LENGTH,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        dtype="float32",
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )


def qwen3_weights(config: Qwen3Config, seed: int = WEIGHT_SEED) -> dict[str, np.ndarray]:
    """Random float32 weights under the key names ``Qwen3ForCausalLM`` loads.

    Matrices are N(0, ``INIT_STD``) like transformers' own init, RMSNorm scales are
    ones. Tensors are drawn in one fixed order from one generator, which is what
    makes the result reproducible. ``lm_head`` is absent because it is tied.
    """
    rng = np.random.default_rng(seed)
    hidden, head_dim = config.hidden_size, config.head_dim
    q_width = config.num_attention_heads * head_dim
    kv_width = (config.num_key_value_heads or config.num_attention_heads) * head_dim  # None means one per head

    def normal(*shape: int, std: float = INIT_STD) -> np.ndarray:
        values: np.ndarray = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        return values

    def ones(size: int) -> np.ndarray:
        return np.ones(size, dtype=np.float32)

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, std=EMBED_STD)}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        weights.update(
            {
                f"{prefix}.input_layernorm.weight": ones(hidden),
                f"{prefix}.self_attn.q_proj.weight": normal(q_width, hidden),
                f"{prefix}.self_attn.k_proj.weight": normal(kv_width, hidden),
                f"{prefix}.self_attn.v_proj.weight": normal(kv_width, hidden),
                f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_width),
                f"{prefix}.self_attn.q_norm.weight": ones(head_dim),
                f"{prefix}.self_attn.k_norm.weight": ones(head_dim),
                f"{prefix}.post_attention_layernorm.weight": ones(hidden),
                f"{prefix}.mlp.gate_proj.weight": normal(config.intermediate_size, hidden),
                f"{prefix}.mlp.up_proj.weight": normal(config.intermediate_size, hidden),
                f"{prefix}.mlp.down_proj.weight": normal(hidden, config.intermediate_size),
            }
        )
    weights["model.norm.weight"] = ones(hidden)
    return weights


def build(target: Path) -> None:
    """Write a complete Hugging Face model directory (config, weights, tokenizer) into ``target``."""
    config = tiny_config()
    config.save_pretrained(str(target))
    save_file(qwen3_weights(config), str(target / "model.safetensors"), metadata={"format": "pt"})
    generation = {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    build_tokenizer(target)
