"""The embedded Llama, Qwen2, Qwen3-MoE and GLM-4 builtins have their families' features."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from twinkle.hub.models.families import build_glm4_tiny, build_llama_tiny, build_qwen2_tiny, build_qwen3_moe_tiny

BUILDERS = {
    "llama": build_llama_tiny,
    "qwen2": build_qwen2_tiny,
    "qwen3-moe": build_qwen3_moe_tiny,
    "glm4": build_glm4_tiny,
}


@pytest.mark.parametrize("family", list(BUILDERS))
def test_each_family_is_built_with_its_own_features(family: str, tmp_path: Path) -> None:
    # Same bytes every build: decoder_weights is shared with builtin://qwen3-tiny, whose test checks that.
    BUILDERS[family](tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    weights = load_file(tmp_path / "a" / "model.safetensors")
    assert config["model_type"] == family.replace("-", "_") and config["vocab_size"] == 151936
    assert weights["model.embed_tokens.weight"].shape == (151936, 64) and "lm_head.weight" not in weights  # tied
    assert ("model.layers.0.self_attn.q_proj.bias" in weights) == (family in ("qwen2", "glm4"))
    assert ("model.layers.0.self_attn.q_norm.weight" in weights) == (family == "qwen3-moe")
    if family == "qwen3-moe":
        assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
        assert weights["model.layers.3.mlp.gate.weight"].shape == (8, 64)
        assert weights["model.layers.3.mlp.experts.7.down_proj.weight"].shape == (64, 64)
    if family == "glm4":
        assert config["rope_parameters"]["partial_rotary_factor"] == 0.5 and config["head_dim"] == 16
        assert weights["model.layers.0.mlp.gate_up_proj.weight"].shape == (512, 64)
        assert weights["model.layers.0.post_mlp_layernorm.weight"].shape == (64,)
    assert (tmp_path / "a" / "tokenizer.json").is_file() and (tmp_path / "a" / "generation_config.json").is_file()
