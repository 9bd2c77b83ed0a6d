"""More embedded model families: ``builtin://llama-tiny``, ``qwen2-tiny``, ``qwen3-moe-tiny`` and ``glm4-tiny``.

Each is its family's real transformers architecture at ``builtin://qwen3-tiny``'s toy size (4 layers, hidden
64, grouped-query attention with 4 query and 2 key/value heads, tied embeddings) with the same Qwen
tokenizer, chat template and special token ids (Llama's own tokenizer is not available offline), so data
encoded once trains any of them. What differs is what the family differs in: Llama has no QK-norm and
Llama 3's rotary base; Qwen2 has biases on q/k/v; Qwen3-MoE has QK-norm and a mixture-of-experts MLP in
every layer (8 experts, 2 per token, renormalised top-k weights, as Qwen3-30B-A3B's config has them);
GLM-4 (GLM-4-9B's architecture) has q/k/v biases, rotary embedding on half of each head, a fused
gate/up projection and "sandwich" norms (after attention and after the MLP as well as before them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinkle.hub.models.decoder_weights import DecoderLayout, decoder_weights
from twinkle.hub.models.qwen3_tiny import ENDOFTEXT_ID, IM_END_ID, PADDED_VOCAB_SIZE, WEIGHT_SEED, write_model
from twinkle.hub.models.tokenizer import MODEL_MAX_LENGTH

__all__ = ["build_glm4_tiny", "build_llama_tiny", "build_qwen2_tiny", "build_qwen3_moe_tiny", "tiny_family_config"]

EXPERTS = 8
TINY_SHAPE: dict[str, Any] = {
    "vocab_size": PADDED_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "dtype": "float32",
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}


def tiny_family_config(family: str) -> Any:
    """The transformers config of ``builtin://<family>-tiny`` (``llama``, ``qwen2``, ``qwen3-moe`` or ``glm4``)."""
    from transformers import Glm4Config, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if family == "llama":
        rope = {"rope_type": "default", "rope_theta": 500_000.0}
        return LlamaConfig(architectures=["LlamaForCausalLM"], head_dim=16, rope_parameters=rope, **TINY_SHAPE)
    if family == "qwen2":
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], rope_parameters=rope, **TINY_SHAPE)
    if family == "qwen3-moe":
        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],  # head_dim: hidden / heads = 16
            moe_intermediate_size=64,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            rope_parameters=rope,
            **TINY_SHAPE,
        )
    if family == "glm4":
        rope = {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}
        return Glm4Config(
            architectures=["Glm4ForCausalLM"], head_dim=16, attention_bias=True, rope_parameters=rope, **TINY_SHAPE
        )
    raise ValueError(f"no embedded {family!r} family (llama, qwen2, qwen3-moe, glm4)")


def build_llama_tiny(target: Path) -> None:
    config = tiny_family_config("llama")
    write_model(target, config, decoder_weights(config, WEIGHT_SEED + 1, DecoderLayout()))


def build_qwen2_tiny(target: Path) -> None:
    config = tiny_family_config("qwen2")
    write_model(target, config, decoder_weights(config, WEIGHT_SEED + 2, DecoderLayout(qkv_bias=True)))


def build_qwen3_moe_tiny(target: Path) -> None:
    config = tiny_family_config("qwen3-moe")
    layout = DecoderLayout(qk_norm=True, experts=EXPERTS)
    write_model(target, config, decoder_weights(config, WEIGHT_SEED + 3, layout))


def build_glm4_tiny(target: Path) -> None:
    config = tiny_family_config("glm4")
    write_model(target, config, decoder_weights(config, WEIGHT_SEED + 4, DecoderLayout(qkv_bias=True, glm=True)))
