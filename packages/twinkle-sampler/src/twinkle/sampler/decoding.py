"""Batched generation over a transformers causal LM with a KV cache and per-row LoRA adapters.

One batch serves several sample calls at once (:class:`GenerationRequest` s, e.g. many tenants' calls on a
server): their prompts are prefilled together and their rows decoded together, while each call's tokens are
chosen with its own parameters, stops and random generator (its ``seed``'s), so a call gets what it would
get alone. Within a call, distinct prompts are prefilled once (left-padded, with matching attention mask
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

from twinkle.data_format import FREE_EXPERT
from twinkle.module import (
    ImageRows,
    MultiLoraLinear,
    RoutingRecord,
    adapter_rows,
    multi_lora_modules,
    record_routing,
)
from twinkle.sampler.prompt_logprobs import prompt_logprobs
from twinkle.sampler.results import Completion, Generation, GenerationRequest, Prompt
from twinkle.sampler.stopping import StopCriteria
from twinkle.sampler.token_sampling import StepTokens, choose_tokens, requested, topk_count, topk_pairs
from twinkle.sampler.vision import image_prefill_inputs, multimodal_base


class _Rows:
    """The rows still generating: which completion each is, of which request, its adapter, attention mask and next
    position.

    ``seen_BS`` (every token so far) is kept only for the repetition penalty;
    a left-padded row's pads repeat one of its real tokens there.
    """

    def __init__(
        self,
        requests: list[int],
        adapters: list[str | None],
        mask_BL: torch.Tensor,
        seen_BS: torch.Tensor | None,
        delta_B: torch.Tensor,
    ) -> None:
        self.completions = list(range(len(adapters)))
        self.requests = requests
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
            self.requests = [self.requests[i] for i in keep]
            self.adapters = [self.adapters[i] for i in keep]
            new_B1, self.mask_BL, self.next_position_B = new_B1[index], self.mask_BL[index], self.next_position_B[index]
            self.seen_BS = None if self.seen_BS is None else self.seen_BS[index]
            cache.batch_select_indices(index)
        self.mask_BL = torch.cat([self.mask_BL, torch.ones_like(new_B1)], dim=-1)
        positions_B1 = self.next_position_B.unsqueeze(-1)
        self.next_position_B = self.next_position_B + 1
        return new_B1, positions_B1


class Decoder:
    """Runs :class:`twinkle.sampler.TorchSampler` requests over its model."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, record: bool = False) -> None:
        self.model = model
        self.record = record
        self.routing: RoutingRecord | None = None
        self.decoder = model.get_decoder()
        self.base: Any = multimodal_base(model)  # a vision-language model's base (takes images); None: text-only
        self.head = model.get_output_embeddings()
        self.pad_token_id = pad_token_id
        self.has_adapters = bool(multi_lora_modules(model))

    def generate(
        self, requests: Sequence[GenerationRequest], generators: Sequence[torch.Generator | None]
    ) -> list[Generation]:
        """Each request's ``num_samples`` consecutive completions per prompt, prompts in input order; request ``r``
        draws its random numbers from ``generators[r]`` (``None``: torch's global generator)."""
        with ExitStack() as stack:
            if self.record:
                self.routing = stack.enter_context(record_routing(self.model))
            return self._generate(requests, generators)

    def _generate(
        self, requests: Sequence[GenerationRequest], generators: Sequence[torch.Generator | None]
    ) -> list[Generation]:
        distinct: dict[tuple[int, tuple[Any, ...]], int] = {}  # (request, prompt group) -> its prefill row
        sources = [
            [distinct.setdefault((r, p.group_key), len(distinct)) for p in request.prompts]
            for r, request in enumerate(requests)
        ]
        firsts: dict[int, Prompt] = {}
        for request, source in zip(requests, sources, strict=True):
            for prompt, u in zip(request.prompts, source, strict=True):
                firsts.setdefault(u, prompt)
        prefilled = [firsts[u] for u in range(len(distinct))]
        ids_UL, mask_UL = self._left_pad([p.input_ids for p in prefilled])
        cache = DynamicCache(config=self.model.config)
        images = image_prefill_inputs([p.feature for p in prefilled], mask_UL, self.base, self.head.weight.dtype)
        delta_U = torch.zeros(len(prefilled), dtype=torch.long, device=ids_UL.device)
        if images is None:
            positions = self._positions(mask_UL)
        else:  # the model's own multimodal positions, and how far each prompt's run ahead of its length
            positions, delta_U1 = self.base.get_rope_index(ids_UL, attention_mask=mask_UL, **images)
            delta_U = delta_U1.reshape(-1).to(ids_UL.device)
        hidden_ULH = self._forward(ids_UL, mask_UL, positions, [p.adapter for p in prefilled], cache, images)
        prompt_routing = self._prompt_routing(mask_UL)
        generations = [Generation(completions=[]) for _ in requests]
        for request, source, generation in zip(requests, sources, generations, strict=True):
            if requested(request.params.prompt_logprobs):
                self._prompt_logprobs(request, source, prefilled, hidden_ULH, ids_UL, mask_UL, generation)
        expand_list = [
            u for r, source in enumerate(sources) for u in source for _ in range(requests[r].params.num_samples)
        ]
        expand = torch.tensor(expand_list, device=ids_UL.device)
        cache.batch_select_indices(expand)
        seen_BS = None
        if any(request.params.repetition_penalty != 1.0 for request in requests):
            seen_BS = torch.where(mask_UL.bool(), ids_UL, ids_UL[:, -1:])[expand]
        row_requests = [r for r, request in enumerate(requests) for _ in range(request.completion_count)]
        adapters = [
            prompt.adapter
            for request in requests
            for prompt in request.prompts
            for _ in range(request.params.num_samples)
        ]
        rows = _Rows(row_requests, adapters, mask_UL[expand], seen_BS, delta_U[expand])
        completions = self._decode(hidden_ULH[:, -1][expand], rows, cache, requests, generators)
        if prompt_routing is not None:
            for completion, u in zip(completions, expand_list, strict=True):
                assert completion.routed_experts is not None
                free = [[FREE_EXPERT] * len(prompt_routing[u][0][0])] * len(prompt_routing[u][0])
                completion.routed_experts = [*prompt_routing[u], *completion.routed_experts, free]
        start = 0
        for request, generation in zip(requests, generations, strict=True):
            generation.completions = completions[start : start + request.completion_count]
            start += request.completion_count
        return generations

    def _prompt_logprobs(
        self,
        request: GenerationRequest,
        source: list[int],
        prefilled: list[Prompt],
        hidden_ULH: torch.Tensor,
        ids_UL: torch.Tensor,
        mask_UL: torch.Tensor,
        generation: Generation,
    ) -> None:
        """The request's prompt log-probs (and top-k alternatives) from its prompts' prefill rows."""
        own = sorted(set(source))
        index = torch.tensor(own, device=ids_UL.device)
        with self._routed([prefilled[u].adapter for u in own]):
            logprobs, alternatives = prompt_logprobs(
                self.head, hidden_ULH[index], ids_UL[index], mask_UL[index], request.params.prompt_logprobs
            )
        row = {u: i for i, u in enumerate(own)}
        generation.prompt_logprobs = [logprobs[row[u]] for u in source]
        generation.topk_prompt_logprobs = None if alternatives is None else [alternatives[row[u]] for u in source]

    def _prompt_routing(self, mask_UL: torch.Tensor) -> list[list[list[list[int]]]] | None:
        """Each distinct prompt's tokens' experts from the prefill (left padding dropped)."""
        if self.routing is None:
            return None
        routed_NLK = self.routing.take()
        routed_UTLK = routed_NLK.view(*mask_UL.shape, *routed_NLK.shape[1:])
        return [routed_UTLK[u][mask_UL[u].bool()].tolist() for u in range(mask_UL.shape[0])]

    def _decode(
        self,
        hidden_BH: torch.Tensor,
        rows: _Rows,
        cache: DynamicCache,
        requests: Sequence[GenerationRequest],
        generators: Sequence[torch.Generator | None],
    ) -> list[Completion]:
        record = self.routing is not None
        completions = []
        for request in requests:
            logprobs, topk = requested(request.params.logprobs), topk_count(request.params.logprobs) > 0
            completions += [
                Completion([], "length", [] if logprobs else None, [] if topk else None, [] if record else None)
                for _ in range(request.completion_count)
            ]
        for step in range(max(request.params.max_tokens for request in requests)):
            logits_BV = self._head_logits(hidden_BH, rows.adapters)
            tokens_B = torch.empty(len(rows.completions), dtype=torch.long, device=logits_BV.device)
            keep: list[int] = []
            for r, positions in _rows_by_request(rows.requests).items():
                request = requests[r]
                if len(positions) == len(rows.completions):  # one request: no copy of the logits
                    chosen = choose_tokens(logits_BV, request.params, generators[r], rows.seen_BS)
                else:
                    index = torch.tensor(positions, device=tokens_B.device)
                    seen_BS = None if rows.seen_BS is None else rows.seen_BS[index]
                    chosen = choose_tokens(logits_BV[index], request.params, generators[r], seen_BS)
                tokens_B[positions] = chosen.tokens_B
                last_step = step == request.params.max_tokens - 1
                keep += self._record(chosen, positions, rows, completions, request.stop, last_step)
            if not keep:
                break
            keep.sort()
            ids_B1, positions_B1 = rows.advance(tokens_B, keep, cache)
            if self.base is not None:  # M-RoPE: one position per rotary section (text tokens: all equal)
                positions_B1 = positions_B1.unsqueeze(0).expand(3, -1, -1)
            hidden_BH = self._forward(ids_B1, rows.mask_BL, positions_B1, rows.adapters, cache)[:, -1]
            if self.routing is not None:  # the experts of the tokens just fed back, one per row
                for number, experts in zip(rows.completions, self.routing.take().tolist(), strict=True):
                    routed_experts = completions[number].routed_experts
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
        chosen: StepTokens,
        positions: list[int],
        rows: _Rows,
        completions: list[Completion],
        stop: StopCriteria,
        last_step: bool,
    ) -> list[int]:
        """Append one request's tokens (its rows at batch ``positions``) to their completions; return the batch
        positions that go on."""
        tokens = chosen.tokens_B.tolist()
        logprobs = None if chosen.logprobs_B is None else chosen.logprobs_B.tolist()
        ids_BK, topk_logprobs_BK = chosen.topk_ids_BK, chosen.topk_logprobs_BK
        topk = None if ids_BK is None or topk_logprobs_BK is None else topk_pairs(ids_BK, topk_logprobs_BK)
        keep = []
        for row, position in enumerate(positions):
            completion = completions[rows.completions[position]]
            completion.tokens.append(tokens[row])
            if logprobs is not None and completion.logprobs is not None:  # both or neither, by request
                completion.logprobs.append(logprobs[row])
            if topk is not None and completion.topk_logprobs is not None:
                completion.topk_logprobs.append(topk[row])
            if tokens[row] in stop.stop_ids or stop.ends_with_stop_string(completion.tokens):
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


def _rows_by_request(requests_B: list[int]) -> dict[int, list[int]]:
    """Each request's batch positions, in batch order."""
    positions: dict[int, list[int]] = {}
    for position, request in enumerate(requests_B):
        positions.setdefault(request, []).append(position)
    return positions
