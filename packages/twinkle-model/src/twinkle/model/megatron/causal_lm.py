"""megatron-core's ``GPTModel`` behind the few transformers methods the pass engine calls.

The engine runs any causal LM the same way: the decoder's last hidden states (``get_decoder()``), then the
output layer (``get_output_embeddings()``) on the positions that predict something, in chunks. Here the
decoder is megatron's embedding and transformer block (:mod:`.decoder`: tensor-parallel layers,
:mod:`.attention`'s core attention) and the output layer is vocabulary-parallel (:mod:`.head`: each rank
computes the targets' log-probs from its slice of the logits, so the losses see what one process would).
Under pipeline parallelism the block holds this stage's layers and every stage gets the last stage's hidden
states (:mod:`.pipeline`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import ModuleSpec, TransformerConfig
from safetensors.torch import save_file
from torch import nn

from twinkle.errors import ConfigurationError
from twinkle.model.megatron.attention import RotaryAttention, RowPositions
from twinkle.model.megatron.conversion import check_supported, head_dim, is_moe, num_experts, to_transformers
from twinkle.model.megatron.decoder import MegatronDecoder, StageOutput
from twinkle.model.megatron.head import VocabParallelHead
from twinkle.model.megatron.lora import FUSED, MegatronLora
from twinkle.model.megatron.moe import MegatronMoE, RouterLogits
from twinkle.model.megatron.pipeline import Outbox, PipelineStage
from twinkle.model.megatron.recompute import checkpoint_layers

WEIGHTS_FILE = "model.safetensors"
PIPELINE_SCHEDULES = ("1f1b", "sequential")


class MegatronCausalLM(nn.Module):
    """A megatron-core GPT model of a transformers config, with this rank's tensor-parallel shards.

    ``stage``: this rank's pipeline stage (its decoder layers); the whole model when omitted.
    ``pipeline_schedule``: ``"1f1b"`` (a stage runs its layers on the next micro-batches while later stages
    are busy with this one, keeping as many micro-batches' activations as stages follow it) or
    ``"sequential"`` (one micro-batch at a time through every stage: the least memory).
    """

    supports_gradient_checkpointing = True  # by :meth:`activation_checkpointing_enable`, as transformers' models

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        rank: int,
        size: int,
        stage: PipelineStage | None = None,
        pipeline_schedule: str = "1f1b",
    ) -> None:
        super().__init__()
        self.stage = stage or PipelineStage(0, 1, 0)
        check_supported(config, size, self.stage.size)
        if pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ConfigurationError(
                f"pipeline_schedule must be one of {list(PIPELINE_SCHEDULES)}, got {pipeline_schedule!r}"
            )
        overlapped = pipeline_schedule == "1f1b"
        self.passes_ahead = self.stage.size - 1 - self.stage.index if overlapped else 0
        self.started: deque[StageOutput] = deque()  # passes this stage started ahead (see MegatronDecoder)
        self.outbox = Outbox()
        self.config = config
        self.group, self.rank, self.size = group, rank, size
        self.positions = RowPositions()
        self.router_logits = RouterLogits()
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        if is_moe(config):
            moe = {"hf_config": config, "group": group, "rank": rank, "size": size, "router_logits": self.router_logits}
            spec.submodules.mlp = ModuleSpec(module=MegatronMoE, params=moe)
        rope_theta = float(config.rope_parameters["rope_theta"])
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = partial(RotaryAttention, positions=self.positions, rope_theta=rope_theta)
        # Every stage builds the embedding and output layer (kept whole across stages, see .pipeline); their
        # tie is ours, as megatron's needs CUDA under pipeline parallelism.
        layer_log = logging.getLogger("megatron.core.transformer.transformer_layer")
        level = layer_log.level
        layer_log.setLevel(logging.ERROR)  # it warns of every MLP module it does not know, as our MoE layer
        try:
            self.gpt = GPTModel(
                config=transformer_config(config, dtype, size, self.stage.size),
                transformer_layer_spec=spec,
                vocab_size=config.vocab_size,
                max_sequence_length=config.max_position_embeddings,
                share_embeddings_and_output_weights=False,
                position_embedding_type="none",
            )
        finally:
            layer_log.setLevel(level)
        if config.tie_word_embeddings:
            self.gpt.output_layer = None
        if not self.stage.is_last:
            self.gpt.decoder.final_layernorm = None
        for weight in self.pipeline_replicated():
            weight.replicated_over_pipeline = True  # type: ignore[attr-defined]
        self.lora = MegatronLora(group, rank, size)
        # The ranks that split the output layer's vocabulary: the tensor-parallel group, with every stage's.
        self.vocab_exchange = (group, size)
        if self.stage.size > 1:
            self.vocab_exchange = (parallel_state.get_model_parallel_group(), size * self.stage.size)
        self.lora.num_experts = num_experts(config)
        for layer in self.gpt.decoder.layers:
            if is_moe(config):
                adapters = self.lora.expert_adapters(layer.layer_number - 1)
                layer.mlp.adapters = layer.mlp.experts.adapters = adapters  # an expert shard takes them over
            for fused in FUSED:
                if fused.startswith("mlp.") and is_moe(config):
                    continue
                index = layer.layer_number - 1  # the model's layer number, whatever the stage
                layer.get_submodule(fused).register_forward_hook(self.lora.hook(index, fused))
            for norm in ("self_attention.q_layernorm", "self_attention.k_layernorm"):  # each rank norms its heads
                layer.get_submodule(norm).weight.partial_over_tensor_parallel = True

    def activation_checkpointing_enable(
        self, activation_checkpointing_kwargs: Mapping[str, Any] | None = None, every_n_layers: int = 1
    ) -> None:
        """Recompute every ``every_n_layers``-th decoder layer in backward (:mod:`.recompute`; non-reentrant)."""
        if (activation_checkpointing_kwargs or {}).get("use_reentrant", False):
            raise ConfigurationError("MegatronModel checkpoints its layers non-reentrantly only")
        checkpoint_layers(self.gpt.decoder.layers, self.positions, every_n_layers)

    def get_input_embeddings(self) -> nn.Module:
        return self.gpt.embedding.word_embeddings  # num_embeddings is the whole vocabulary's

    def pipeline_replicated(self) -> list[nn.Parameter]:
        """The weights every pipeline stage holds whole: the word embeddings and an untied output layer."""
        if self.stage.size == 1:
            return []
        weights = [self.gpt.embedding.word_embeddings.weight]
        return weights if self.gpt.output_layer is None else [*weights, self.gpt.output_layer.weight]

    def get_output_embeddings(self) -> VocabParallelHead:
        layer = self.gpt.output_layer
        weight = self.gpt.embedding.word_embeddings.weight if layer is None else layer.weight
        return VocabParallelHead(weight, self.config.vocab_size, self.lora, self.stage, self.vocab_exchange)

    def expert_sizes(self) -> tuple[int, dict[str, tuple[int, int]]] | None:
        """A MoE model's experts per layer and each fused expert tensor's per-expert ``(out, in)``, whole."""
        c = self.config
        if not is_moe(c):
            return None
        width, hidden, experts = c.moe_intermediate_size, c.hidden_size, num_experts(c)
        return experts, {"gate_up_proj": (2 * width, hidden), "down_proj": (hidden, width), "router": (experts, hidden)}

    @property
    def stage_layers(self) -> range:
        """The decoder layers this rank holds, by the model's numbering."""
        per_stage = self.config.num_hidden_layers // self.stage.size
        return range(self.stage.first_layer, self.stage.first_layer + per_stage)

    def get_decoder(self) -> MegatronDecoder:
        return MegatronDecoder(self)

    def projection_sizes(self) -> dict[str, tuple[int, int]]:
        """Each transformers projection of a decoder layer as ``(out_features, in_features)``, whole."""
        c, dim = self.config, head_dim(self.config)
        hidden, queries, keys = c.hidden_size, c.num_attention_heads * dim, c.num_key_value_heads * dim
        attention = {
            "self_attn.q_proj": (queries, hidden),
            "self_attn.k_proj": (keys, hidden),
            "self_attn.v_proj": (keys, hidden),
            "self_attn.o_proj": (hidden, queries),
        }
        if is_moe(c):  # LoRA on the attention only: the experts are parameters, not linears
            return attention
        return {
            **attention,
            "mlp.gate_proj": (c.intermediate_size, hidden),
            "mlp.up_proj": (c.intermediate_size, hidden),
            "mlp.down_proj": (hidden, c.intermediate_size),
        }

    def save_pretrained(self, directory: str, state_dict: Mapping[str, torch.Tensor], **_: Any) -> None:
        """A transformers checkpoint directory from whole megatron tensors (``state_dict`` as gathered)."""
        megatron = {name.removeprefix("gpt."): t for name, t in state_dict.items() if name.startswith("gpt.")}
        tensors = to_transformers(megatron, self.config)
        self.config.save_pretrained(directory)
        save_file({name: t.detach().cpu() for name, t in tensors.items()}, str(Path(directory) / WEIGHTS_FILE))

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: Any = None, **_: Any
    ) -> torch.Tensor:
        """Greedy continuation of one row, recomputing the whole prefix per token (a quick check, no cache)."""
        eos = self.config.eos_token_id
        stops: set[int] = set(eos if isinstance(eos, list) else [eos]) - {None}
        tokens = input_ids
        head = self.get_output_embeddings()
        for _step in range(max_new_tokens):
            hidden_BSH = self.get_decoder()(tokens).last_hidden_state
            next_token = head(hidden_BSH[:, -1]).argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            if int(next_token[0, 0]) in stops:
                break
        return tokens


def transformer_config(config: Any, dtype: torch.dtype, tp_size: int, pp_size: int = 1) -> TransformerConfig:
    """megatron-core's description of a supported transformers decoder, with no CUDA-only fusions."""
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=head_dim(config),
        ffn_hidden_size=config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=nn.functional.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
