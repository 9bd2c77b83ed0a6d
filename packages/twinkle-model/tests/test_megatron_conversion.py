"""The HF <-> megatron-core converter's two sets of megatron names: the local layer spec's and Transformer Engine's.

The Transformer-Engine names are checked against megatron-core's own record of how the two specs' names
differ (the local spec's ``sharded_state_dict_keys_map``, which megatron uses to save local-spec models in
TE-spec checkpoints), and both layouts round-trip a transformers state dict exactly. (No Transformer Engine
here: it needs CUDA. The local layout is the one MegatronModel builds, tested against transformers in
test_megatron.py.)
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model

pytest.importorskip("twinkle.model.megatron", reason="needs twinkle-model[megatron]")
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from twinkle.model.megatron.conversion import to_megatron, to_transformers

MODEL = "builtin://qwen3-tiny"
MOE_MODEL = "builtin://qwen3-moe-tiny"
TE = "transformer_engine"


def _transformers_state(model_id: str) -> tuple[dict[str, torch.Tensor], Any]:
    model = AutoModelForCausalLM.from_pretrained(resolve_model(model_id), dtype=torch.float32)
    state = {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    if not model.config.tie_word_embeddings:
        state["lm_head.weight"] = model.lm_head.weight.detach()
    return state, model.config


def _as_te_spec_names(name: str, keys_map: dict[str, str]) -> str:
    """A local-spec parameter name as megatron-core maps it into the Transformer-Engine spec's checkpoints."""
    match = re.match(r"(decoder\.layers\.\d+\.)(.*)", name)
    if match is None:
        return name
    prefix, rest = match.groups()
    for local, engine in keys_map.items():
        if rest.startswith(local):
            return prefix + engine + rest.removeprefix(local)
    return name


@pytest.mark.parametrize("layout", ["local", TE])
@pytest.mark.parametrize("model_id", [MODEL, MOE_MODEL], ids=["dense", "moe"])
def test_both_layouts_round_trip_a_transformers_state_dict_exactly(model_id, layout):
    state, config = _transformers_state(model_id)
    back = to_transformers(to_megatron(state, config, layout), config, layout)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_dense_transformer_engine_names_are_megatrons_own_mapping_of_the_local_ones():
    state, config = _transformers_state(MODEL)
    local = to_megatron(state, config)
    engine = to_megatron(state, config, TE)
    keys_map = get_gpt_layer_local_spec(
        qk_layernorm=True, normalization="RMSNorm"
    ).submodules.sharded_state_dict_keys_map
    assert keys_map  # megatron's input_layernorm. -> linear_qkv.layer_norm_, pre_mlp_layernorm. -> linear_fc1's
    mapped = {_as_te_spec_names(name, keys_map): tensor for name, tensor in local.items()}
    assert mapped.keys() == engine.keys()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in engine
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in engine
    for name, tensor in mapped.items():
        assert torch.equal(engine[name], tensor), name


def test_moe_transformer_engine_layout_has_one_grouped_gemm_weight_per_expert():
    """The TE spec keeps a MoE layer's norm before the MLP (the router needs its output) and groups its experts:
    ``linear_fc1.weight{e}`` is expert ``e``'s gate over its up projection, ``linear_fc2.weight{e}`` its down."""
    state, config = _transformers_state(MOE_MODEL)
    engine = to_megatron(state, config, TE)
    layer, hf = "decoder.layers.1.", "model.layers.1."
    assert torch.equal(
        engine[layer + "self_attention.linear_qkv.layer_norm_weight"], state[hf + "input_layernorm.weight"]
    )
    assert torch.equal(engine[layer + "pre_mlp_layernorm.weight"], state[hf + "post_attention_layernorm.weight"])
    assert torch.equal(engine[layer + "mlp.router.weight"], state[hf + "mlp.gate.weight"])
    experts = config.num_experts
    assert f"{layer}mlp.experts.linear_fc1.weight{experts}" not in engine  # the experts of one layer, numbered from 0
    for expert in range(experts):
        gate_up = state[hf + "mlp.experts.gate_up_proj"][expert]
        assert torch.equal(engine[f"{layer}mlp.experts.linear_fc1.weight{expert}"], gate_up)
        assert torch.equal(
            engine[f"{layer}mlp.experts.linear_fc2.weight{expert}"], state[hf + "mlp.experts.down_proj"][expert]
        )
    assert not any("gate_up_proj" in name or name.endswith("input_layernorm.weight") for name in engine)


def test_an_unknown_layout_is_refused_by_name():
    state, config = _transformers_state(MODEL)
    with pytest.raises(
        ConfigurationError, match="layout='te' is not a megatron-core layout; one of local, transformer_engine"
    ):
        to_megatron(state, config, "te")
