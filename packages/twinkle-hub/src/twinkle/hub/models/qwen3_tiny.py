"""``builtin://qwen3-tiny``: a 10M-parameter Qwen3 causal LM that trains and samples on a CPU.

It is a real Qwen3 architecture (grouped-query attention, q/k RMSNorm, SwiGLU,
tied embeddings) with the real Qwen3 vocabulary and tokenizer, only narrow and
shallow. Code paths exercised on it (LoRA targets, checkpoint key names, chat
templates, token ids) are therefore the ones a real Qwen3 checkpoint takes.

Weights come from :func:`twinkle.hub.models.decoder_weights.decoder_weights` (a
fixed-seed numpy generator), written with ``safetensors.numpy``, so every build
writes the same bytes and torch is not needed to build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors.numpy import save_file

from twinkle.hub.models.chat_template import QWEN3_CHAT_TEMPLATE
from twinkle.hub.models.decoder_weights import DecoderLayout, decoder_weights
from twinkle.hub.models.tokenizer import BPE_VOCAB_SIZE, MODEL_MAX_LENGTH, build_tokenizer

if TYPE_CHECKING:
    from transformers import Qwen3Config

WEIGHT_SEED = 20250601

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
    """Random float32 weights under the key names ``Qwen3ForCausalLM`` loads (``lm_head`` is tied)."""
    return decoder_weights(config, seed, DecoderLayout(qk_norm=True))


def build(target: Path) -> None:
    """Write a complete Hugging Face model directory (config, weights, tokenizer) into ``target``."""
    config = tiny_config()
    write_model(target, config, qwen3_weights(config))


def build_head32(target: Path) -> None:
    """``build`` with attention heads 32 wide (the least vLLM's CPU attention kernels take): wider q/k/v/o."""
    config = tiny_config()
    config.head_dim = 32
    write_model(target, config, qwen3_weights(config))


def write_model(
    target: Path, config: Any, weights: dict[str, np.ndarray], chat_template: str = QWEN3_CHAT_TEMPLATE
) -> None:
    """A model directory with ``config``, ``weights`` and the Qwen tokenizer, chat template and generation ids."""
    config.save_pretrained(str(target))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    generation = {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    build_tokenizer(target, chat_template)
