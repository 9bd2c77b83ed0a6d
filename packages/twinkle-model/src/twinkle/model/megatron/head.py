"""The output layer of :class:`.causal_lm.MegatronCausalLM`: vocabulary-parallel under tensor parallelism.

Each rank holds its rows of the output weight (its slice of the vocabulary) and the adapters' updates of
them. The pass engine asks it for log-probabilities of chosen tokens (:meth:`VocabParallelHead.token_logps_for`),
which each rank computes from its own slice of the logits: the group exchanges a few numbers per token (the
largest logit, the sum of exponentials, the targets' logits, the argmax), never the ``[tokens, vocabulary]``
logits. Only a caller that wants the logits themselves (``forward``: ``return_logits``, ``generate``) gets
them gathered whole.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from twinkle.model.megatron.collectives import copy_to_group, gather_last_dim, sum_over_group
from twinkle.model.megatron.lora import MegatronLora
from twinkle.module import RowRouting, logps_dtype


class VocabParallelHead(nn.Module):
    """The output layer: this rank's vocabulary rows of ``weight`` (plus the routed rows' LoRA updates of them).
    Its input's rows are dim 0 (``[B, T, H]`` or ``[B, H]``); flattened tokens of the batch go through
    :meth:`token_logps_for`."""

    weight: torch.Tensor
    lora: MegatronLora

    def __init__(self, weight: torch.Tensor, vocab_size: int, lora: MegatronLora, frozen: bool) -> None:
        super().__init__()
        object.__setattr__(self, "weight", weight)  # the model's own tensor, not a second registration
        object.__setattr__(self, "lora", lora)  # the model's adapters, not a second registration
        self.out_features = vocab_size
        self.frozen = frozen  # a pipeline stage other than the first: no gradients (see .pipeline)

    def forward(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """The logits, gathered whole over the group."""
        lora = self.lora
        return gather_last_dim(self._local_logits(hidden_NH, lora.routing), lora.group, lora.rank, lora.size)

    def token_logps_for(
        self, rows_N: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``(hidden_NH, targets_NK) -> (log p(targets_NK), argmax == targets_NK[:, 0])`` on ``N`` flattened
        tokens, token ``n`` one of batch row ``rows_N[n]``; the routing is taken now, so a chunk recomputed in
        backward (after the routed block) computes the same."""
        return partial(self._token_logps, routing=self._routing_of(rows_N))

    def _routing_of(self, rows_N: torch.Tensor) -> RowRouting | None:
        routing = self.lora.routing
        return None if routing is None else routing.for_tokens(rows_N)

    def _local_logits(self, hidden_NH: torch.Tensor, routing: RowRouting | None) -> torch.Tensor:
        lora = self.lora
        hidden_NH = copy_to_group(hidden_NH, lora.group, lora.size)  # each rank's slice adds to its gradient
        local_NV = nn.functional.linear(hidden_NH, self.weight)
        return lora.with_head_updates(local_NV, hidden_NH, routing, self.frozen)

    def _token_logps(
        self, hidden_NH: torch.Tensor, targets_NK: torch.Tensor, routing: RowRouting | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lora = self.lora
        local_NV = self._local_logits(hidden_NH, routing)
        local_NV = local_NV.to(logps_dtype(local_NV.dtype))
        return vocab_parallel_logps(local_NV, targets_NK, lora.group, lora.rank, lora.size)


def vocab_parallel_logps(
    local_NV: torch.Tensor, targets_NK: torch.Tensor, group: dist.ProcessGroup | None, rank: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits)[targets_NK]`` and ``argmax(logits) == targets_NK[:, 0]``, where the logits are every
    rank's ``local_NV`` joined along the vocabulary in rank order (equal widths), without joining them.

    ``logsumexp = max + log Σ_ranks Σ exp(local - max)`` for any ``max`` (the largest logit, for range); a
    target's logit comes from the rank holding it. The sums pass their gradient through unchanged (every rank
    computes the same loss from them), so each rank's logits get ``onehot - softmax`` on its own slice.
    """
    width = local_NV.shape[-1]
    first = rank * width
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
    """The index of the largest of the joined logits (the first, on ties: as ``argmax`` of the whole)."""
    values_N, indices_N = local_NV.max(dim=-1)  # the first largest of this slice
    if size == 1:
        return indices_N
    values_RN = [torch.empty_like(values_N) for _ in range(size)]
    indices_RN = [torch.empty_like(indices_N) for _ in range(size)]
    dist.all_gather(values_RN, values_N, group=group)
    dist.all_gather(indices_RN, indices_N + first, group=group)
    winner_N = torch.stack(values_RN).argmax(dim=0)  # the first rank holding the largest: the lowest index
    return torch.stack(indices_RN).gather(0, winner_N[None])[0]
