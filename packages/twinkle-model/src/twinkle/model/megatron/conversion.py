"""Weights between transformers' and megatron-core's layouts, and cut into tensor-parallel shards.

transformers names a Qwen3 decoder layer's projections one by one; megatron-core fuses them:

- ``linear_qkv`` holds, for each key/value head group in turn, that group's query heads, then its key
  head, then its value head (so a tensor-parallel rank's rows are whole groups);
- ``linear_fc1`` is ``gate_proj`` stacked on ``up_proj`` (``partition_stride`` 2: each rank holds its
  part of both);
- the layer norms and QK-norms keep their own tensors under other names.

Two sets of megatron names (``layout``): ``"local"``, the local layer spec's, which :class:`MegatronModel`
builds; and ``"transformer_engine"``, the Transformer-Engine spec's (``get_gpt_layer_with_transformer_engine_spec``),
where the layer norm before attention is fused into ``linear_qkv`` (``layer_norm_weight``), so is a dense
layer's norm before its MLP into ``linear_fc1``, and a MoE layer's experts are grouped GEMMs
(``mlp.experts.linear_fc1.weight{e}`` for expert ``e`` of the whole model, ``mlp.router.weight``). TE's
``_extra_state`` entries (FP8 metadata) are not weights: they are neither made nor read here.

A tensor-parallel parameter carries megatron's ``partition_dim`` and ``partition_stride``;
:func:`local_part` cuts a whole tensor to a rank's shard by them and :func:`whole` joins the shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from twinkle.errors import ConfigurationError

SUPPORTED_FAMILIES = ("qwen3", "qwen3_moe")
LAYOUTS = ("local", "transformer_engine")
# transformers' per-layer name -> megatron-core's, for tensors that move as they are.
_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_DENSE_NAMES = {"mlp.down_proj.weight": "mlp.linear_fc2.weight"}
_MOE_NAMES = {  # a MoE layer's router and fused experts (.moe's parameters), in transformers' layouts
    "mlp.gate.weight": "mlp.router",
    "mlp.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj": "mlp.experts.down_proj",
}


def head_dim(config: Any) -> int:
    """Each attention head's width (Qwen3-MoE configs leave it implicit)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def num_experts(config: Any) -> int:
    """The experts of each MoE layer; 0 for a dense model."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def is_moe(config: Any) -> bool:
    return num_experts(config) > 0


def check_supported(config: Any, tp_size: int, pp_size: int = 1, ep_size: int = 1) -> None:
    """Refuse a model or a parallel size (tensor, pipeline, expert) this back-end cannot run, naming the misfit."""
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ConfigurationError(
            f"MegatronModel converts {', '.join(SUPPORTED_FAMILIES)} models; {config.model_type!r} is not one"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or getattr(config, "use_sliding_window", False):
        raise ConfigurationError("MegatronModel supports default rotary embeddings without sliding windows")
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size or groups % tp_size:
        raise ConfigurationError(
            f"tp_size={tp_size} must divide the attention heads (num_attention_heads={heads}) and the query "
            f"groups (num_key_value_heads={groups})"
        )
    if is_moe(config) and (config.mlp_only_layers or config.decoder_sparse_step != 1):
        raise ConfigurationError("MegatronModel supports MoE models whose every layer is a MoE layer")
    width = ("moe_intermediate_size", config.moe_intermediate_size) if is_moe(config) else None
    for name, size in (width or ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if size % tp_size:
            raise ConfigurationError(f"tp_size={tp_size} must divide the model's {name} ({size})")
    if ep_size > 1 and not is_moe(config):
        raise ConfigurationError(f"ep_size={ep_size}: {config.model_type} has no MoE experts to spread over the ranks")
    if ep_size > 1 and num_experts(config) % ep_size:
        raise ConfigurationError(
            f"ep_size={ep_size} must divide the experts of each MoE layer (num_experts={num_experts(config)})"
        )
    if config.num_hidden_layers % pp_size:
        raise ConfigurationError(
            f"pp_size={pp_size} must divide the decoder layers (num_hidden_layers={config.num_hidden_layers})"
        )


def to_megatron(state: Mapping[str, torch.Tensor], config: Any, layout: str = "local") -> dict[str, torch.Tensor]:
    """A transformers state dict of a supported family in megatron-core's names (of ``layout``) and layouts."""
    _check_layout(layout)
    heads, groups, dim = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
    names = {**_LAYER_NAMES, **(_MOE_NAMES if is_moe(config) else _DENSE_NAMES)}
    out = {
        "embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": state["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for layer in range(config.num_hidden_layers):
        hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_name, mc_name in names.items():
            out[mc + mc_name] = state[hf + hf_name]
        q = state[hf + "self_attn.q_proj.weight"].view(groups, heads // groups * dim, -1)
        k = state[hf + "self_attn.k_proj.weight"].view(groups, dim, -1)
        v = state[hf + "self_attn.v_proj.weight"].view(groups, dim, -1)
        out[mc + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        if not is_moe(config):
            gate, up = state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"]
            out[mc + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
    return _to_transformer_engine(out, config) if layout == "transformer_engine" else out


def to_transformers(state: Mapping[str, torch.Tensor], config: Any, layout: str = "local") -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_megatron`: megatron-core's whole tensors (named as in ``layout``) under
    transformers' names."""
    _check_layout(layout)
    if layout == "transformer_engine":
        state = _from_transformer_engine(state, config)
    heads, groups, dim = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
    names = {**_LAYER_NAMES, **(_MOE_NAMES if is_moe(config) else _DENSE_NAMES)}
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    for layer in range(config.num_hidden_layers):
        hf, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        for hf_name, mc_name in names.items():
            out[hf + hf_name] = state[mc + mc_name]
        qkv = state[mc + "self_attention.linear_qkv.weight"].view(groups, (heads // groups + 2) * dim, -1)
        q, k, v = qkv.split([heads // groups * dim, dim, dim], dim=1)
        out[hf + "self_attn.q_proj.weight"] = q.reshape(heads * dim, -1)
        out[hf + "self_attn.k_proj.weight"] = k.reshape(groups * dim, -1)
        out[hf + "self_attn.v_proj.weight"] = v.reshape(groups * dim, -1)
        if not is_moe(config):
            gate, up = state[mc + "mlp.linear_fc1.weight"].chunk(2)
            out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigurationError(f"layout={layout!r} is not a megatron-core layout; one of {', '.join(LAYOUTS)}")


def _engine_names(config: Any) -> dict[str, str]:
    """A layer's local-spec name -> its Transformer-Engine-spec name, for tensors that only change names."""
    names = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
    if is_moe(config):
        return {**names, "mlp.router": "mlp.router.weight"}  # its norm before the MLP stays a norm of its own
    return {**names, "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


# A MoE layer's fused experts (local) -> the Transformer-Engine spec's grouped GEMMs, one tensor per expert.
_GROUPED_EXPERTS = {
    "mlp.experts.gate_up_proj": "mlp.experts.linear_fc1.weight",
    "mlp.experts.down_proj": "mlp.experts.linear_fc2.weight",
}


def _to_transformer_engine(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The local layout's tensors under the Transformer-Engine spec's names (and its experts one by one)."""
    renames = _engine_names(config)
    for layer in range(config.num_hidden_layers):
        mc = f"decoder.layers.{layer}."
        for local, engine in renames.items():
            state[mc + engine] = state.pop(mc + local)
        if is_moe(config):
            for fused, grouped in _GROUPED_EXPERTS.items():
                for expert, weight in enumerate(state.pop(mc + fused).unbind(0)):
                    state[f"{mc}{grouped}{expert}"] = weight
    return state


def _from_transformer_engine(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_to_transformer_engine`."""
    local = dict(state)
    renames = _engine_names(config)
    for layer in range(config.num_hidden_layers):
        mc = f"decoder.layers.{layer}."
        for name, engine in renames.items():
            local[mc + name] = local.pop(mc + engine)
        if is_moe(config):
            for fused, grouped in _GROUPED_EXPERTS.items():
                experts = [local.pop(f"{mc}{grouped}{expert}") for expert in range(num_experts(config))]
                local[mc + fused] = torch.stack(experts)
    return local


def is_sharded(param: torch.Tensor) -> bool:
    """A tensor-parallel parameter (each rank holds a part), as megatron-core marks them."""
    return bool(getattr(param, "tensor_model_parallel", False)) and getattr(param, "partition_dim", -1) >= 0


def local_part(full: torch.Tensor, param: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` for ``param`` (``full`` itself for a replicated parameter)."""
    if size == 1 or not is_sharded(param):
        return full
    dim, stride = _partition(param)
    parts = full.chunk(stride * size, dim)  # with stride s, each of the s stacked blocks is split over the ranks
    return torch.cat([parts[block * size + rank] for block in range(stride)], dim).clone()


def whole(local: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """The whole tensor of which every rank of ``group`` holds ``local`` (a collective; the inverse of local_part)."""
    if size == 1 or not is_sharded(param):
        return local
    dim, stride = _partition(param)
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.detach().contiguous(), group=group)
    blocks = [shard.chunk(stride, dim) for shard in shards]  # [rank][block]
    return torch.cat([blocks[rank][block] for block in range(stride) for rank in range(size)], dim)


def _partition(param: Any) -> tuple[int, int]:
    """``(partition_dim, partition_stride)``, which megatron-core sets on its tensor-parallel parameters."""
    return param.partition_dim, getattr(param, "partition_stride", 1)
