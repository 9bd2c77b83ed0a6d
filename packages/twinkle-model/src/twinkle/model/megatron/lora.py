"""LoRA adapters on megatron-core's tensor-parallel linears, one pair per transformers projection, PEFT's format.

An adapter is described by a PEFT ``LoraConfig`` over transformers' names (``q_proj`` ... ``down_proj``),
trained and saved as PEFT would (``lora_A [r, in]``, ``lora_B [out, r]`` per projection), so plain
transformers + PEFT load it. megatron fuses projections, so the pairs ride on its linears:

- on the column-parallel ``linear_qkv`` and ``linear_fc1`` every rank computes its rows of each fused
  projection's update: ``A`` whole on every rank (its gradient, partial per rank, is summed over the
  group), ``B`` cut by rows like the weight; the updates are laid out as the fused output is
  (``[q, k, v]`` per key/value group; ``[gate, up]``);
- on the row-parallel ``linear_proj`` and ``linear_fc2`` each rank holds ``A``'s columns for its input
  slice; the rank-r product is summed over the group and ``B`` (whole) maps it out;
- on the vocabulary-parallel output layer (``lm_head``) ``A`` is whole and ``B`` cut by rows, as the
  output layer's weight: each rank adds its vocabulary slice's update (:meth:`MegatronLora.with_head_updates`).
  Every pipeline stage holds the pair and computes its part of the vocabulary (see :mod:`.head`); as for the
  word embeddings, the stages' gradients are summed (``replicated_over_pipeline``).

The pairs are kept in :class:`MegatronLora` beside the model's layers (whose parameters keep megatron's
names) and added to a layer's output by a forward hook. Each batch row gets its own adapter's update (or
none): a forward runs under :meth:`MegatronLora.routed`, whose :class:`~twinkle.module.RowRouting` picks the
rows (dim 1 of megatron's ``[S, B, H]``; a MoE layer's flattened tokens map back to their rows), so many
tenants' adapters train in one pass over one base.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model.megatron.collectives import copy_to_group, sum_over_group
from twinkle.model.megatron.expert_lora import (
    expert_pair,
    expert_rank,
    expert_targets,
    expert_update,
    initial_A,
    unknown_targets,
)
from twinkle.module import RowRouting, pattern_value

# megatron's linear of a decoder layer -> the transformers projections it fuses, in its output's order.
FUSED = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
_ROW_PARALLEL = {"self_attention.linear_proj", "mlp.linear_fc2"}
HEAD = "lm_head"  # the output layer's transformers (and PEFT) module name
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "modules_to_save": "modules_to_save"}


class MegatronLora(nn.Module):
    """Every adapter's pairs, by adapter and transformers module name (``model.layers.0.self_attn.q_proj``)."""

    adapters: nn.ModuleDict

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        super().__init__()
        self.group, self.rank, self.size = group, rank, size
        self.adapters = nn.ModuleDict()  # adapter name -> ModuleDict(hf module name with '.' as '/' -> pair)
        self.configs: dict[str, LoraConfig] = {}
        self.scaling: dict[str, dict[str, float]] = {}  # adapter -> module -> scaling, every layer's
        # adapter -> (layer, fused expert tensor) -> the PEFT module name its pair is saved under
        self.expert_modules: dict[str, dict[tuple[int, str], str]] = {}
        self.num_experts = 0  # per MoE layer; 0 for a dense model
        self.expert_block = (0, 1)  # (this rank's block of every layer's experts, blocks): expert parallelism
        self.routing: RowRouting | None = None  # the current forward's rows of each adapter
        self.row_tags: torch.Tensor | None = None  # and each row's adapter, as token_tags numbers it

    def add(
        self,
        name: str,
        config: Any,
        num_layers: int,
        sizes: dict[str, tuple[int, int]],
        like: torch.Tensor,
        layers: range | None = None,
        experts: tuple[int, dict[str, tuple[int, int]]] | None = None,
        head: tuple[int, int] | None = None,
        pipeline: bool = False,
    ) -> None:
        """Create adapter ``name`` (PEFT's initialisation, drawn whole, then cut to this rank's part).

        ``sizes``: each adaptable transformers projection's ``(out_features, in_features)``; ``like``: a base weight,
        whose dtype and device the pairs take; ``layers``: the decoder layers this rank holds (a pipeline
        stage's; every layer's pairs are drawn, so each starts as in one process); ``experts``: a MoE model's
        experts per layer and each fused expert tensor's per-expert ``(out, in)`` (for ``target_parameters``);
        ``head``: the output layer's ``(vocab_size, hidden_size)``; ``pipeline``: the model has several stages.
        """
        config = _checked(name, config, num_layers)
        kept = range(num_layers) if layers is None else layers
        pairs, scaling, matched = nn.ModuleDict(), {}, False
        expert_tensors: dict[int, list[tuple[str, str]]] = {}
        for layer, param, module in expert_targets(config, num_layers):
            if experts is None:
                raise ConfigurationError(f"adapter {name!r}: target_parameters (MoE experts) need a MoE model")
            expert_tensors.setdefault(layer, []).append((param, module))
        # First, as the word embeddings: a pair every stage holds precedes the stages' own, so the stages'
        # optimizer states join in one process's order.
        if head is not None and check_target_module_exists(config, HEAD):
            rank = int(pattern_value(config.rank_pattern or {}, HEAD, config.r))
            alpha = float(pattern_value(config.alpha_pattern or {}, HEAD, config.lora_alpha))
            matched = True
            head_pair = self._pair(HEAD, rank, head, like)
            for param in head_pair.values():
                param.replicated_over_pipeline = pipeline
            pairs[_key(HEAD)] = head_pair
            scaling[HEAD] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        for layer in range(num_layers):
            for projections in FUSED.values():
                for projection in projections:
                    module = f"model.layers.{layer}.{projection}"
                    if projection not in sizes or not check_target_module_exists(config, module):
                        continue  # a projection the model has not (a MoE model's MLP), or not targeted
                    rank = int(pattern_value(config.rank_pattern or {}, module, config.r))
                    alpha = float(pattern_value(config.alpha_pattern or {}, module, config.lora_alpha))
                    matched = True
                    pair = self._pair(projection, rank, sizes[projection], like)
                    scaling[module] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank  # every layer's
                    if layer in kept:
                        pairs[_key(module)] = pair
            for param, module in expert_tensors.get(layer, []):
                assert experts is not None
                rank, alpha = expert_rank(config, layer, param)
                matched = True
                count = 1 if param == "router" else experts[0]  # the router's weight is one matrix
                block = (0, 1) if param == "router" else self.expert_block
                pair = expert_pair(param, rank, count, experts[1][param], like, (self.rank, self.size), block)
                scaling[module] = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
                self.expert_modules.setdefault(name, {})[(layer, param)] = module
                if layer in kept:
                    pairs[_key(module)] = pair
        if not matched:
            raise ConfigurationError(
                f"adapter {name!r}: target_modules {config.target_modules!r} match no projection of the decoder "
                f"layers ({', '.join(p.rsplit('.', 1)[-1] for ps in FUSED.values() for p in ps)}) or the output "
                f"layer ({HEAD})"
            )
        self.adapters[name], self.configs[name], self.scaling[name] = pairs, config, scaling

    def _pair(self, projection: str, rank: int, shape: tuple[int, int], like: torch.Tensor) -> nn.ParameterDict:
        out_features, in_features = shape
        A = initial_A(rank, in_features, like)  # the whole matrix on every rank
        B = torch.zeros(out_features, rank, dtype=like.dtype, device=like.device)
        row = projection != HEAD and _fused_of(projection) in _ROW_PARALLEL
        pair = nn.ParameterDict({"A": nn.Parameter(A), "B": nn.Parameter(B)})
        _mark(pair["A"], sharded_dim=1 if row else None, partial=not row, size=self.size, rank=self.rank)
        _mark(pair["B"], sharded_dim=None if row else 0, partial=False, size=self.size, rank=self.rank)
        return pair

    def parameters_of(self, name: str) -> list[nn.Parameter]:
        return list(self.adapters[name].parameters())

    def state_dict_of(self, name: str) -> dict[str, torch.Tensor]:
        """PEFT-format keys to this rank's parts of the pairs (``save`` gathers them whole)."""
        pairs: Any = self.adapters[name]
        return {
            f"base_model.model.{_module(key)}.lora_{part}.weight": tensor
            for key, pair in pairs.items()
            for part, tensor in pair.items()
        }

    def remove(self, name: str) -> None:
        del self.adapters[name], self.configs[name], self.scaling[name]
        self.expert_modules.pop(name, None)

    def expert_adapters(self, layer: int) -> LayerExpertAdapters:
        """Decoder layer ``layer``'s pairs on its experts and router, for its MoE modules (see .moe)."""
        return LayerExpertAdapters(self, layer)

    def token_tags(self, tokens: int) -> torch.Tensor | None:
        """Each of the flattened ``[S·B]`` tokens' adapter, as its index among :attr:`adapters` (-1: none);
        ``None`` outside :meth:`routed`. Every rank holds the same adapters in the same order, so a tag means
        the same adapter on the rank an expert-parallel exchange sends the token to."""
        if self.row_tags is None:
            return None
        return self.row_tags.repeat(tokens // len(self.row_tags))  # token s·B + b is one of row b

    def expert_delta(
        self, layer: int, param: str, expert: int, x: torch.Tensor, tags: torch.Tensor
    ) -> torch.Tensor | None:
        """The update of layer ``layer``'s MoE tensor ``param`` (expert ``expert`` of this rank's) for rows ``x``
        tagged by :meth:`token_tags`; ``None`` when no tagged adapter adapts it."""
        names, total = list(self.adapters), None
        count = 1 if param == "router" else self.num_experts // self.expert_block[1]  # this rank's experts
        for tag in tags.unique().tolist():
            module = self.expert_modules.get(names[tag], {}).get((layer, param)) if tag >= 0 else None
            if module is None:
                continue
            pairs: Any = self.adapters[names[tag]]
            mine = tags == tag
            picked = None if bool(mine.all()) else mine.nonzero().squeeze(1)
            x_n = x if picked is None else x.index_select(0, picked)
            delta = expert_update(pairs[_key(module)], count, self.scaling[names[tag]][module], expert, x_n)
            if picked is not None:
                delta = delta.new_zeros(x.shape[0], delta.shape[-1]).index_add(0, picked, delta)
            total = delta if total is None else total + delta
        return total

    def with_head_updates(
        self, local_NV: torch.Tensor, x: torch.Tensor, routing: RowRouting | None, vocab: slice, frozen: bool
    ) -> torch.Tensor:
        """``local_NV`` (rows ``vocab`` of this rank's vocabulary slice of the output layer, for ``x``) plus the
        adapters' updates of ``x``'s rows (dim 0, as ``routing`` assigns them), added in place of a
        vocabulary-wide zero buffer per adapter; ``frozen``: without gradients to the pairs."""
        for name, rows in () if routing is None else routing.of_input(x.shape[0]).groups:
            pairs: Any = self.adapters[name]
            if _key(HEAD) not in pairs:
                continue
            A, B = pairs[_key(HEAD)]["A"], pairs[_key(HEAD)]["B"][vocab]
            A, B = (A.detach(), B.detach()) if frozen else (A, B)
            x_n = x if rows is None else x.index_select(0, rows)
            dropout = float(self.configs[name].lora_dropout)
            x_n = nn.functional.dropout(x_n, dropout, training=self.training) if dropout else x_n
            delta = (x_n @ A.T @ B.T * self.scaling[name][HEAD]).to(local_NV.dtype)
            local_NV = local_NV + delta if rows is None else local_NV.index_add(0, rows, delta)
        return local_NV

    @contextmanager
    def routed(self, row_adapters: Sequence[str | None], device: torch.device) -> Iterator[None]:
        """Within the block, batch row ``i`` gets adapter ``row_adapters[i]``'s updates (``None``: none)."""
        unknown = sorted({name for name in row_adapters if name is not None and name not in self.adapters})
        if unknown:
            raise InvalidInputError(f"unknown adapter(s) {unknown}; adapters: {sorted(self.adapters)}")
        names = list(self.adapters)
        tags = [-1 if name is None else names.index(name) for name in row_adapters]
        previous = self.routing, self.row_tags
        self.routing = RowRouting.of_rows(row_adapters, device)
        self.row_tags = torch.tensor(tags, dtype=torch.long, device=device)  # once per forward, for every MoE layer
        try:
            yield
        finally:
            self.routing, self.row_tags = previous

    def hook(self, layer: int, fused: str) -> Any:
        """The forward hook of decoder layer ``layer``'s megatron linear ``fused``."""
        names = [f"model.layers.{layer}.{projection}" for projection in FUSED[fused]]

        def add_updates(module: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> Any:
            if self.routing is None:
                return output
            out, bias = output
            x_SBI = inputs[0]
            for name, rows in self.routing.of_input(x_SBI.shape[1]).groups:
                pairs: Any = self.adapters[name]
                if not any(_key(n) in pairs for n in names):
                    continue
                x = x_SBI if rows is None else x_SBI.index_select(1, rows)
                delta = self._delta(x, names, fused, module, name).to(out.dtype)
                out = out + delta if rows is None else out.index_add(1, rows, delta)
            return out, bias

        return add_updates

    def _delta(self, x: torch.Tensor, names: list[str], fused: str, module: Any, adapter: str) -> torch.Tensor:
        """Adapter ``adapter``'s update of ``fused``'s output (this rank's part) for the rows ``x``."""
        pairs: Any = self.adapters[adapter]
        scaling = self.scaling[adapter]
        dropout = float(self.configs[adapter].lora_dropout)
        if dropout and module.training:
            x = nn.functional.dropout(x, dropout)
        if fused in _ROW_PARALLEL:  # x holds this rank's input slice; A its columns
            pair = pairs[_key(names[0])]
            down = sum_over_group(x @ pair["A"].T, self.group, self.size)
            return down @ pair["B"].T * scaling[names[0]]
        x = copy_to_group(x, self.group, self.size)
        parts = []
        for name in names:
            if _key(name) not in pairs:  # a projection this adapter leaves alone
                parts.append(x.new_zeros(*x.shape[:-1], _local_rows(module, fused, name, self.size)))
                continue
            pair = pairs[_key(name)]
            parts.append(x @ pair["A"].T @ pair["B"].T * scaling[name])
        if fused == "mlp.linear_fc1":
            return torch.cat(parts, dim=-1)
        groups = module.config.num_query_groups // self.size  # linear_qkv: [q, k, v] per local group
        return torch.cat([part.unflatten(-1, (groups, -1)) for part in parts], dim=-1).flatten(-2)


def _local_rows(module: Any, fused: str, name: str, size: int) -> int:
    """How many output rows this rank computes for projection ``name`` of ``fused``."""
    config = module.config
    if fused == "mlp.linear_fc1":
        return int(config.ffn_hidden_size) // size
    heads = config.num_attention_heads if name.endswith("q_proj") else config.num_query_groups
    return int(heads * config.kv_channels) // size


def _mark(param: nn.Parameter, sharded_dim: int | None, partial: bool, size: int, rank: int) -> None:
    """Cut ``param`` to this rank's part along ``sharded_dim`` and say so as megatron marks its own shards."""
    if sharded_dim is not None and size > 1:
        param.data = param.data.chunk(size, sharded_dim)[rank].clone()
    param.tensor_model_parallel = sharded_dim is not None  # type: ignore[attr-defined]
    param.partition_dim = -1 if sharded_dim is None else sharded_dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]
    param.partial_over_tensor_parallel = partial  # type: ignore[attr-defined]


def _checked(name: str, config: Any, num_layers: int) -> LoraConfig:
    """A copy of ``config`` with ``"all-linear"`` spelled out, or a refusal naming what is not supported."""
    if not isinstance(config, LoraConfig):
        raise ConfigurationError(f"adapter {name!r}: MegatronModel trains LoRA adapters, got {type(config).__name__}")
    for option, feature in _UNSUPPORTED.items():
        if getattr(config, option, None):
            raise ConfigurationError(f"adapter {name!r} uses {feature}, which MegatronModel does not support")
    unknown = unknown_targets(config, num_layers)
    if unknown:
        raise ConfigurationError(
            f"adapter {name!r}: target_parameters {unknown} name no MoE parameter (mlp.experts.gate_up_proj, "
            "mlp.experts.down_proj, mlp.gate.weight)"
        )
    config = copy.deepcopy(config)
    targets = config.target_modules
    if isinstance(targets, str) and targets.lower() == "all-linear":  # PEFT's: every linear but the output layer
        config.target_modules = sorted({p.rsplit(".", 1)[-1] for ps in FUSED.values() for p in ps})
    return config


def _fused_of(projection: str) -> str:
    return next(fused for fused, projections in FUSED.items() if projection in projections)


def _key(module: str) -> str:
    return module.replace(".", "/")  # ModuleDict keys cannot hold dots


def _module(key: str) -> str:
    return key.replace("/", ".")


@dataclass(frozen=True)
class LayerExpertAdapters:
    """One decoder layer's :class:`~twinkle.model.parallel.experts.ExpertAdapters`: its pairs in ``lora``."""

    lora: MegatronLora
    layer: int

    def token_tags(self, tokens: int) -> torch.Tensor | None:
        return self.lora.token_tags(tokens)

    def update(self, param: str, expert: int, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor | None:
        return self.lora.expert_delta(self.layer, param, expert, x, tags)
