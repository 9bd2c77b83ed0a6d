"""The output layer of :class:`.causal_lm.MegatronCausalLM`: split by vocabulary over the model-parallel ranks.

Under tensor parallelism each rank holds its rows of the output weight (its slice of the vocabulary) and the
adapters' updates of them; under pipeline parallelism every stage holds the weight (see :mod:`.pipeline`) and
takes its part of that slice, so the stages share the output layer's work instead of repeating it. The pass
engine asks for log-probabilities of chosen tokens (:meth:`VocabParallelHead.token_logps_for`), which each
rank computes from its own slice of the logits: the ranks exchange a few numbers per token (the largest logit,
the sum of exponentials, the targets' logits, the argmax), never the ``[tokens, vocabulary]`` logits. Only a
caller that wants the logits themselves (``forward``: ``return_logits``, ``generate``) gets them gathered
whole over the tensor-parallel group, every stage computing them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from twinkle.model.megatron.collectives import copy_to_group, gather_last_dim, sum_over_group
from twinkle.model.megatron.lora import MegatronLora
from twinkle.model.megatron.pipeline import PipelineStage
from twinkle.module import RowRouting, logps_dtype


class VocabParallelHead(nn.Module):
    """The output layer: this rank's vocabulary rows of ``weight`` (plus the routed rows' LoRA updates of them).

    ``exchange``: the group (and its size) of the ranks that split the vocabulary between them, tensor-parallel
    ranks and pipeline stages. Its input's rows are dim 0 (``[B, T, H]`` or ``[B, H]``); flattened tokens of
    the batch go through :meth:`token_logps_for`.
    """

    weight: torch.Tensor
    lora: MegatronLora

    def __init__(
        self,
        weight: torch.Tensor,
        vocab_size: int,
        lora: MegatronLora,
        stage: PipelineStage,
        exchange: tuple[dist.ProcessGroup | None, int],
    ) -> None:
        super().__init__()
        object.__setattr__(self, "weight", weight)  # the model's own tensor, not a second registration
        object.__setattr__(self, "lora", lora)  # the model's adapters, not a second registration
        self.out_features = vocab_size
        self.stage, self.exchange = stage, exchange
        local = weight.shape[0]  # this tensor-parallel rank's rows; this stage takes its part of them
        self.own = slice(local * stage.index // stage.size, local * (stage.index + 1) // stage.size)
        self.first = lora.rank * local + self.own.start  # the vocabulary id of this rank's first row

    def forward(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """The logits, gathered whole over the tensor-parallel group. Every stage computes them; the gradient
        reaches the model through one copy each: the last stage's hidden states, the first stage's weights."""
        lora, stage = self.lora, self.stage
        hidden_NH = hidden_NH if stage.is_last else hidden_NH.detach()
        local_NV = self._local_logits(hidden_NH, lora.routing, slice(None), frozen=not stage.is_first)
        return gather_last_dim(local_NV, lora.group, lora.rank, lora.size)

    def token_logps_for(
        self, rows_N: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``(hidden_NH, targets_NK) -> (log p(targets_NK), argmax == targets_NK[:, 0])`` on ``N`` flattened
        tokens, token ``n`` one of batch row ``rows_N[n]``; the routing is taken now, so a chunk recomputed in
        backward (after the routed block) computes the same."""
        routing = self.lora.routing
        return partial(self._token_logps, routing=None if routing is None else routing.for_tokens(rows_N))

    def _local_logits(
        self, hidden_NH: torch.Tensor, routing: RowRouting | None, rows: slice, frozen: bool
    ) -> torch.Tensor:
        """The logits of this rank's ``rows`` of the weight; ``frozen``: without gradients to the weights."""
        lora = self.lora
        hidden_NH = copy_to_group(hidden_NH, lora.group, lora.size)  # each rank's slice adds to its gradient
        weight = self.weight[rows]
        local_NV = nn.functional.linear(hidden_NH, weight.detach() if frozen else weight)
        return lora.with_head_updates(local_NV, hidden_NH, routing, rows, frozen)

    def _token_logps(
        self, hidden_NH: torch.Tensor, targets_NK: torch.Tensor, routing: RowRouting | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        local_NV = self._local_logits(hidden_NH, routing, self.own, frozen=False)
        local_NV = local_NV.to(logps_dtype(local_NV.dtype))
        group, size = self.exchange
        return vocab_parallel_logps(local_NV, targets_NK, self.first, group, size)


def vocab_parallel_logps(
    local_NV: torch.Tensor, targets_NK: torch.Tensor, first: int, group: dist.ProcessGroup | None, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits)[targets_NK]`` and ``argmax(logits) == targets_NK[:, 0]``, where the logits are the
    ``size`` ranks' ``local_NV`` together, this rank's being vocabulary ids ``first`` on, without joining them.

    ``logsumexp = max + log Σ_ranks Σ exp(local - max)`` for any ``max`` (the largest logit, for range); a
    target's logit comes from the rank holding it. The sums pass their gradient through unchanged (every rank
    computes the same loss from them), so each rank's logits get ``onehot - softmax`` on its own slice.
    """
    width = local_NV.shape[-1]
    max_N = local_NV.detach().amax(dim=-1)
    if size > 1:
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
    sum_exp_N = sum_over_group((local_NV - max_N[:, None]).exp().sum(dim=-1), group, size)
    held_NK = (targets_NK >= first) & (targets_NK < first + width)
    local_targets_NK = torch.where(held_NK, targets_NK - first, 0)
    target_NK = sum_over_group(local_NV.gather(-1, local_targets_NK) * held_NK, group, size)
    logps_NK = target_NK - max_N[:, None] - sum_exp_N.log()[:, None]
    return logps_NK, _argmax(local_NV.detach(), first, group, size) == targets_NK[:, 0]


def _argmax(local_NV: torch.Tensor, first: int, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """The vocabulary id of the largest of the ranks' logits (the lowest, on ties: as ``argmax`` of the whole)."""
    values_N, indices_N = local_NV.max(dim=-1)  # the first largest of this slice
    if size == 1:
        return indices_N + first
    values_RN = [torch.empty_like(values_N) for _ in range(size)]
    indices_RN = [torch.empty_like(indices_N) for _ in range(size)]
    dist.all_gather(values_RN, values_N, group=group)
    dist.all_gather(indices_RN, indices_N + first, group=group)
    values, indices = torch.stack(values_RN), torch.stack(indices_RN)
    largest = values == values.amax(dim=0, keepdim=True)
    return torch.where(largest, indices, torch.iinfo(indices.dtype).max).amin(dim=0)
