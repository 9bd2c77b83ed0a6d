"""Batched generation over a transformers causal LM with a KV cache and per-row LoRA adapters.

Distinct prompts are prefilled once (left-padded, with matching attention mask
and position ids); their cache rows are then repeated for every sample that
continues them, so ``num_samples`` copies of a prompt — or the same prompt sent
several times — cost one prefill. Each step runs the decoder on the newest
token of every unfinished row and the output layer on those rows only; rows
that finish leave the batch (and the cache), so long completions do not drag
short ones along. Every forward, the output layer's included (LoRA may
target ``lm_head``), runs under :func:`twinkle.module.adapter_rows`, so each
row sees its own adapter, or none. When routing is recorded, each forward's
chosen experts are kept per completion: its prompt's from the prefill, then
each token's from the step that feeds it back (the last token is never fed
back, nothing depends on its experts: it is left free).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from twinkle.data_format import FREE_EXPERT, SamplingParams
from twinkle.module import (
    ImageRows,
    MultiLoraLinear,
    RoutingRecord,
    adapter_rows,
    multi_lora_modules,
    record_routing,
)
from twinkle.sampler.prompt_logprobs import prompt_logprobs
from twinkle.sampler.results import Completion, Generation, Prompt
from twinkle.sampler.stopping import StopCriteria
from twinkle.sampler.token_sampling import StepTokens, choose_tokens, requested, topk_count, topk_pairs
from twinkle.sampler.vision import image_prefill_inputs, multimodal_base


class _Rows:
    """The rows still generating: which completion each is, its adapter, attention mask and next position.

    ``seen_BS`` (every token so far) is kept only for the repetition penalty;
    a left-padded row's pads repeat one of its real tokens there.
    """

    def __init__(
        self, adapters: list[str | None], mask_BL: torch.Tensor, seen_BS: torch.Tensor | None, delta_B: torch.Tensor
    ) -> None:
        self.completions = list(range(len(adapters)))
        self.adapters = adapters
        self.mask_BL = mask_BL
        self.seen_BS = seen_BS
        self.next_position_B = mask_BL.sum(dim=-1) + delta_B  # delta: image prompts' M-RoPE shift (vision.py)

    def advance(
        self, tokens_B: torch.Tensor, keep: list[int], cache: DynamicCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the step's tokens and drop finished rows (``keep``: those that go on); the next ids and positions."""
        new_B1 = tokens_B.unsqueeze(-1)
        if self.seen_BS is not None:
            self.seen_BS = torch.cat([self.seen_BS, new_B1], dim=-1)
        if len(keep) < len(self.completions):
            index = torch.tensor(keep, device=new_B1.device)
            self.completions = [self.completions[i] for i in keep]
            self.adapters = [self.adapters[i] for i in keep]
            new_B1, self.mask_BL, self.next_position_B = new_B1[index], self.mask_BL[index], self.next_position_B[index]
            self.seen_BS = None if self.seen_BS is None else self.seen_BS[index]
            cache.batch_select_indices(index)
        self.mask_BL = torch.cat([self.mask_BL, torch.ones_like(new_B1)], dim=-1)
        positions_B1 = self.next_position_B.unsqueeze(-1)
        self.next_position_B = self.next_position_B + 1
        return new_B1, positions_B1


class Decoder:
    """Runs one :class:`twinkle.sampler.TorchSampler` request over its model."""

    def __init__(
        self, model: PreTrainedModel, pad_token_id: int, generator: torch.Generator | None, record: bool = False
    ) -> None:
        self.model = model
        self.record = record
        self.routing: RoutingRecord | None = None
        self.decoder = model.get_decoder()
        self.base: Any = multimodal_base(model)  # a vision-language model's base (takes images); None: text-only
        self.head = model.get_output_embeddings()
        self.pad_token_id = pad_token_id
        self.generator = generator
        self.has_adapters = bool(multi_lora_modules(model))

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams, stop: StopCriteria) -> Generation:
        """``params.num_samples`` consecutive completions per prompt, prompts in input order."""
        with ExitStack() as stack:
            if self.record:
                self.routing = stack.enter_context(record_routing(self.model))
            return self._generate(prompts, params, stop)

    def _generate(self, prompts: Sequence[Prompt], params: SamplingParams, stop: StopCriteria) -> Generation:
        distinct: dict[tuple[tuple[int, ...], str | None, str | None], int] = {}
        source = [distinct.setdefault(p.group_key, len(distinct)) for p in prompts]
        firsts = [prompts[source.index(u)] for u in range(len(distinct))]
        ids_UL, mask_UL = self._left_pad([p.input_ids for p in firsts])
        cache = DynamicCache(config=self.model.config)
        images = image_prefill_inputs([p.feature for p in firsts], mask_UL, self.base, self.head.weight.dtype)
        delta_U = torch.zeros(len(firsts), dtype=torch.long, device=ids_UL.device)
        if images is None:
            positions = self._positions(mask_UL)
        else:  # the model's own multimodal positions, and how far each prompt's run ahead of its length
            positions, delta_U1 = self.base.get_rope_index(ids_UL, attention_mask=mask_UL, **images)
            delta_U = delta_U1.reshape(-1).to(ids_UL.device)
        hidden_ULH = self._forward(ids_UL, mask_UL, positions, [p.adapter for p in firsts], cache, images)
        prompt_routing = self._prompt_routing(mask_UL)
        generation = Generation(completions=[])
        if requested(params.prompt_logprobs):
            with self._routed([p.adapter for p in firsts]):
                logprobs, alternatives = prompt_logprobs(self.head, hidden_ULH, ids_UL, mask_UL, params.prompt_logprobs)
            generation.prompt_logprobs = [logprobs[u] for u in source]
            generation.topk_prompt_logprobs = None if alternatives is None else [alternatives[u] for u in source]
        expand = torch.tensor([u for u in source for _ in range(params.num_samples)], device=ids_UL.device)
        cache.batch_select_indices(expand)
        seen_BS = None
        if params.repetition_penalty != 1.0:
            seen_BS = torch.where(mask_UL.bool(), ids_UL, ids_UL[:, -1:])[expand]
        adapters = [prompt.adapter for prompt in prompts for _ in range(params.num_samples)]
        rows = _Rows(adapters, mask_UL[expand], seen_BS, delta_U[expand])
        generation.completions = self._decode(hidden_ULH[:, -1][expand], rows, cache, params, stop)
        if prompt_routing is not None:
            for completion, prompt in zip(generation.completions, expand.tolist(), strict=True):
                assert completion.routed_experts is not None
                free = [[FREE_EXPERT] * len(prompt_routing[prompt][0][0])] * len(prompt_routing[prompt][0])
                completion.routed_experts = [*prompt_routing[prompt], *completion.routed_experts, free]
        return generation

    def _prompt_routing(self, mask_UL: torch.Tensor) -> list[list[list[list[int]]]] | None:
        """Each distinct prompt's tokens' experts from the prefill (left padding dropped)."""
        if self.routing is None:
            return None
        routed_NLK = self.routing.take()
        routed_UTLK = routed_NLK.view(*mask_UL.shape, *routed_NLK.shape[1:])
        return [routed_UTLK[u][mask_UL[u].bool()].tolist() for u in range(mask_UL.shape[0])]

    def _decode(
        self, hidden_BH: torch.Tensor, rows: _Rows, cache: DynamicCache, params: SamplingParams, stop: StopCriteria
    ) -> list[Completion]:
        logprobs, topk = requested(params.logprobs), topk_count(params.logprobs) > 0
        record = self.routing is not None
        completions = [
            Completion([], "length", [] if logprobs else None, [] if topk else None, [] if record else None)
            for _ in rows.adapters
        ]
        for step in range(params.max_tokens):
            chosen = choose_tokens(self._head_logits(hidden_BH, rows.adapters), params, self.generator, rows.seen_BS)
            keep = self._record(chosen, rows, completions, stop, last_step=step == params.max_tokens - 1)
            if not keep:
                break
            ids_B1, positions_B1 = rows.advance(chosen.tokens_B, keep, cache)
            if self.base is not None:  # M-RoPE: one position per rotary section (text tokens: all equal)
                positions_B1 = positions_B1.unsqueeze(0).expand(3, -1, -1)
            hidden_BH = self._forward(ids_B1, rows.mask_BL, positions_B1, rows.adapters, cache)[:, -1]
            if self.routing is not None:  # the experts of the tokens just fed back, one per row
                for index, experts in zip(rows.completions, self.routing.take().tolist(), strict=True):
                    routed_experts = completions[index].routed_experts
                    assert routed_experts is not None
                    routed_experts.append(experts)
        return completions

    def _forward(
        self,
        ids_BT: torch.Tensor,
        mask_BL: torch.Tensor,
        positions_BT: torch.Tensor,
        adapters: list[str | None],
        cache: DynamicCache,
        images: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder's hidden states; with ``images``, the vision-language base's (positions ``[3, B, T]``)."""
        decoder, extra = (self.decoder, {}) if images is None else (self.base, images)
        with self._routed(adapters, images):
            output = decoder(
                input_ids=ids_BT,
                attention_mask=mask_BL,
                position_ids=positions_BT,
                cache=cache,
                use_cache=True,
                **extra,
            )
        return output.last_hidden_state

    def _head_logits(self, hidden_BH: torch.Tensor, adapters: list[str | None]) -> torch.Tensor:
        """The output layer on one position per row; an adapted one (LoRA on ``lm_head``) with each row's adapter."""
        if not isinstance(self.head, MultiLoraLinear):
            return self.head(hidden_BH)
        with self._routed(adapters):
            return self.head(hidden_BH)

    def _routed(
        self, adapters: list[str | None], images: dict[str, torch.Tensor] | None = None
    ) -> AbstractContextManager[object]:
        """Row ``i`` with adapter ``adapters[i]``, its images' patches too (a no-op without adapters)."""
        if not self.has_adapters:
            return nullcontext()
        if images is None:
            return adapter_rows(self.model, adapters)
        rows = ImageRows.of_batch(self.base.visual, images["mm_token_type_ids"], images["image_grid_thw"])
        return adapter_rows(self.model, adapters, rows)

    @staticmethod
    def _record(
        chosen: StepTokens, rows: _Rows, completions: list[Completion], stop: StopCriteria, last_step: bool
    ) -> list[int]:
        """Append the step's tokens to their completions; return the batch positions that go on."""
        tokens = chosen.tokens_B.tolist()
        logprobs = None if chosen.logprobs_B is None else chosen.logprobs_B.tolist()
        ids_BK, topk_logprobs_BK = chosen.topk_ids_BK, chosen.topk_logprobs_BK
        topk = None if ids_BK is None or topk_logprobs_BK is None else topk_pairs(ids_BK, topk_logprobs_BK)
        keep = []
        for position, index in enumerate(rows.completions):
            completion = completions[index]
            completion.tokens.append(tokens[position])
            if logprobs is not None and completion.logprobs is not None:  # both or neither, by request
                completion.logprobs.append(logprobs[position])
            if topk is not None and completion.topk_logprobs is not None:
                completion.topk_logprobs.append(topk[position])
            if tokens[position] in stop.stop_ids or stop.ends_with_stop_string(completion.tokens):
                completion.stop_reason = "stop"
            elif not last_step:
                keep.append(position)
        return keep

    def _left_pad(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.head.weight.device
        length = max(len(ids) for ids in sequences)
        ids_BL = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        mask_BL = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, ids in enumerate(sequences):
            ids_BL[row, length - len(ids) :] = torch.tensor(ids)
            mask_BL[row, length - len(ids) :] = 1
        return ids_BL.to(device), mask_BL.to(device)

    @staticmethod
    def _positions(mask_BL: torch.Tensor) -> torch.Tensor:
        """Position ids counting real tokens only, so a left-padded row is positioned as if unpadded."""
        return (mask_BL.cumsum(dim=-1) - 1).clamp(min=0)
