"""The decoder of :class:`.causal_lm.MegatronCausalLM`: megatron's embedding and this stage's transformer layers.

It is what the pass engine's ``decode`` calls (``get_decoder()``): ``input_ids`` (and the batch's mask and
positions) to the last hidden states, every stage getting the last stage's (:mod:`.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from twinkle.model.megatron.collectives import copy_to_group
from twinkle.model.megatron.pipeline import gather_over_stages, receive_final, receive_hidden, send_final, send_on

if TYPE_CHECKING:
    from twinkle.model.megatron.causal_lm import MegatronCausalLM


@dataclass
class StageOutput:
    """This stage's layers' work on one pass: ``hidden_SBH`` the model's last hidden states on the last stage,
    on an earlier one the anchor of its send to the next (see :func:`.pipeline.send_on`); and its MoE layers'
    router logits (when asked for)."""

    input_ids: torch.Tensor
    hidden_SBH: torch.Tensor
    router_logits: list[torch.Tensor]


class MegatronDecoder(nn.Module):
    """``input_ids`` (and the batch's mask and positions) to the last hidden states ``[B, S, H]``.

    Under pipeline parallelism the pass engine may :meth:`start` this stage's layers on a later pass before it
    finishes this one (one forward, one backward: ``passes_ahead`` on this stage, as many as later stages
    there are); :meth:`forward` on that pass's inputs then takes up what :meth:`start` did.
    """

    owner: MegatronCausalLM

    def __init__(self, owner: MegatronCausalLM) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a submodule: its parameters are the owner's

    @property
    def passes_ahead(self) -> int:
        """How many later passes this stage runs its layers on before it finishes a pass."""
        return self.owner.passes_ahead

    def start(self, **inputs: Any) -> None:
        """This stage's layers on a later pass's inputs (:meth:`forward`'s), now; their output is sent on."""
        self.owner.started.append(self._stage(**inputs))

    def finish_passes(self) -> None:
        """After a call's passes: drop what was started and never finished (a failed call), and wait for the
        sends still in flight."""
        self.owner.started.clear()
        self.owner.outbox.wait()

    def forward(self, input_ids: torch.Tensor, output_router_logits: bool = False, **inputs: Any) -> SimpleNamespace:
        """``last_hidden_state [B, S, H]``; with ``output_router_logits``, every MoE layer's ``[B·S, E]`` too.
        ``inputs``: the batch's ``attention_mask`` and ``position_ids`` (see :meth:`_stage`)."""
        owner, stage = self.owner, self.owner.stage
        rows, length = input_ids.shape
        if not owner.started:
            done = self._stage(input_ids, output_router_logits=output_router_logits, **inputs)
        else:
            done = owner.started.popleft()
            if done.input_ids is not input_ids:  # the engine finishes passes in the order it starts them
                raise RuntimeError("a pipeline stage was asked to finish a pass it did not start next")
        hidden_SBH, router_logits = done.hidden_SBH, done.router_logits
        if not stage.is_last:
            hidden_SBH = receive_final(hidden_SBH, (length, rows, owner.config.hidden_size))
        if stage.size > 1:  # each stage's output layer adds its part of the gradient (.head): summed for the last
            hidden_SBH = copy_to_group(hidden_SBH, stage.group, stage.size)
        if output_router_logits and stage.size > 1:  # every layer's, as one process has them
            router_logits = gather_over_stages(router_logits, stage)
        output = SimpleNamespace(last_hidden_state=hidden_SBH.transpose(0, 1))
        if output_router_logits:  # batch-major, as transformers' MoE layers give them
            output.router_logits = tuple(
                logits_NE.view(length, rows, -1).transpose(0, 1).reshape(rows * length, -1)
                for logits_NE in router_logits
            )
        return output

    def _stage(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        output_router_logits: bool = False,
        **_: Any,  # use_cache and the like: megatron keeps no cache here
    ) -> StageOutput:
        """This stage's layers on the pass: the embedding or the previous stage's output in, the result sent on
        (to the next stage, or from the last to every earlier one)."""
        owner, stage = self.owner, self.owner.stage
        rows, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(rows, length)
        owner.positions.position_ids_BS = position_ids
        if output_router_logits:
            owner.router_logits.logits = []
        try:
            if stage.is_first:
                embedded_SBH = owner.gpt.embedding(input_ids=input_ids, position_ids=position_ids)
            else:
                weight = owner.gpt.embedding.word_embeddings.weight
                embedded_SBH = receive_hidden(weight.new_empty(length, rows, owner.config.hidden_size), owner.outbox)
            mask = block_mask(attention_mask, position_ids)
            hidden_SBH = owner.gpt.decoder(hidden_states=embedded_SBH, attention_mask=mask)
            router_logits = owner.router_logits.logits or []
        finally:
            owner.positions.position_ids_BS = None
            owner.router_logits.logits = None
        if not stage.is_last:
            hidden_SBH = send_on(hidden_SBH, owner.outbox)
        elif stage.size > 1:
            hidden_SBH = send_final(hidden_SBH, stage, owner.outbox)
        return StageOutput(input_ids, hidden_SBH, router_logits)


def block_mask(attention_mask_BS: torch.Tensor | None, position_ids_BS: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S, S]``, ``True`` where a query may not see a key: later tokens, padding, other packed sequences.

    Each token always sees itself, so no row of the softmax is empty (a padding query's output is unused).
    """
    length = position_ids_BS.shape[1]
    device = position_ids_BS.device
    later = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    sequence_BS = (position_ids_BS == 0).cumsum(dim=1)  # packed rows: positions restart at each sequence
    other = sequence_BS[:, :, None] != sequence_BS[:, None, :]
    masked = later[None] | other
    if attention_mask_BS is not None:
        masked = masked | (attention_mask_BS[:, None, :] == 0)
    masked = masked & ~torch.eye(length, dtype=torch.bool, device=device)[None]
    return masked[:, None]
