import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from twinkle.hub import resolve_model
from twinkle.hub.models.decoder_weights import EMBED_STD, INIT_STD


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), output_loading_info=True)


def test_directory_holds_a_complete_hf_model(tiny_model_dir):
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_config_is_a_tiny_qwen3(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    expected = {
        "vocab_size": 151936,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 16,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "dtype": "float32",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == 1e6


def test_generation_config_stops_on_both_end_tokens(tiny_model_dir):
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    assert generation["pad_token_id"] == 151643


def test_transformers_loads_every_weight_with_no_leftovers(loaded):
    model, info = loaded
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_forward_and_loss(loaded):
    import torch

    model, _ = loaded
    input_ids = torch.tensor([[151644, 872, 198, 13048, 151645]])
    output = model(input_ids=input_ids, labels=input_ids)
    assert output.logits.shape == (1, 5, 151936)
    assert torch.isfinite(output.logits).all()
    # Random weights: logits are roughly N(0, s^2) with s = |h| * EMBED_STD = 8 * 0.25 = 2, so the
    # loss sits a few nats above a uniform guess (ln V + s^2 / 2 from the log-normal partition function).
    uniform = np.log(151936)
    assert uniform + 1 < output.loss.item() < uniform + 3 * (8 * EMBED_STD) ** 2 / 2


def test_weights_follow_the_documented_init(tiny_model_dir):
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert all(tensor.dtype == np.float32 for tensor in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (151936, 64)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert abs(weights["model.embed_tokens.weight"].std() - EMBED_STD) < 1e-3
    assert abs(weights["model.layers.0.mlp.up_proj.weight"].std() - INIT_STD) < 1e-3
    assert np.array_equal(weights["model.layers.3.self_attn.q_norm.weight"], np.ones(16, dtype=np.float32))
    assert np.array_equal(weights["model.norm.weight"], np.ones(64, dtype=np.float32))


def test_two_builds_in_different_caches_are_byte_identical(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_CACHE_DIR", str(tmp_path))
    rebuilt = Path(resolve_model("builtin://qwen3-tiny"))
    assert rebuilt != tiny_model_dir
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert sha256(rebuilt / name) == sha256(tiny_model_dir / name), name
