"""vLLM's inputs and outputs in Twinkle's terms: sampling parameters, completions, prompt log-probs, chunks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import SamplingParams, StopReason
from twinkle.sampler.results import Completion, TopK
from twinkle.sampler.stopping import StopCriteria
from twinkle.sampler.token_sampling import requested, topk_count
from twinkle.sampler.vllm_async import SampleChunk


def vllm_params(params: SamplingParams, stop: StopCriteria) -> Any:
    """Twinkle's :class:`SamplingParams` in vLLM's terms (stop ids include the model's end-of-sequence ids)."""
    from vllm import SamplingParams as VllmSamplingParams

    return VllmSamplingParams(
        n=params.num_samples,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        repetition_penalty=params.repetition_penalty,
        ignore_eos=params.ignore_eos,
        stop=list(stop.stop_strings),
        stop_token_ids=sorted(stop.stop_ids),
        logprobs=topk_count(params.logprobs) if requested(params.logprobs) else None,
        prompt_logprobs=topk_count(params.prompt_logprobs) if requested(params.prompt_logprobs) else None,
    )


def completion(sample: Any, with_logprobs: bool, k: int) -> Completion:
    """One vLLM ``CompletionOutput``: per position, a dict ``{token_id: Logprob}`` holding the sampled token."""
    tokens = list(sample.token_ids)
    reason: StopReason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
    completion = Completion(tokens, reason)
    if with_logprobs:
        completion.logprobs = [position[token].logprob for token, position in zip(tokens, sample.logprobs, strict=True)]
    if k:
        completion.topk_logprobs = [top(position, k) for position in sample.logprobs]
    return completion


def prompt_logprobs(ids: list[int], positions: list[Any], k: int) -> tuple[list[float | None], list[TopK | None]]:
    logprobs: list[float | None] = [None]
    alternatives: list[TopK | None] = [None]
    for token, position in zip(ids[1:], positions[1:], strict=True):
        logprobs.append(position[token].logprob)
        alternatives.append(top(position, k))
    return logprobs, alternatives


def top(position: Mapping[int, Any], k: int) -> TopK:
    """The ``k`` best alternatives of one position, most likely first (vLLM adds the sampled token if outside)."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(token, entry.logprob) for token, entry in ranked[:k]]


def chunks(index: int, output: Any, with_logprobs: bool) -> list[SampleChunk]:
    """The :class:`SampleChunk` s of one streamed (``DELTA``) ``RequestOutput`` of input ``index``."""
    return [
        SampleChunk(
            input_index=index,
            sample_index=sample.index,
            tokens=list(sample.token_ids),
            logprobs=completion(sample, with_logprobs, 0).logprobs,
            stop_reason=None if sample.finish_reason is None else completion(sample, False, 0).stop_reason,
        )
        for sample in output.outputs
    ]
