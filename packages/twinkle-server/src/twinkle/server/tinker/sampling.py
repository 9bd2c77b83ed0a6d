"""Tinker's ``asample``: its request mapped onto Twinkle's sampler, and the reply in the SDK's protobuf."""

from __future__ import annotations

from typing import Any

from twinkle.data_format import SamplingParams
from twinkle.errors import InvalidInputError
from twinkle.server.services.pool import ModelPool
from twinkle.server.tinker.codec import SampledSeq, encode_sample_response
from twinkle.server.tinker.replies import proto_result

DEFAULT_MAX_TOKENS = 256


def prompt_tokens(prompt: Any) -> list[int]:
    """The token ids of a ``ModelInput`` (text-only: this server hosts language models)."""
    try:
        tokens = prompt.to_ints()
    except ValueError as exc:
        raise InvalidInputError(f"prompt: only encoded_text chunks are supported by this server ({exc})") from exc
    if not tokens:
        raise InvalidInputError("prompt is empty")
    return tokens


def sampling_params(request: Any) -> SamplingParams:
    """The Twinkle ``SamplingParams`` for a Tinker ``SampleRequest`` (checked: the caller gets a 400 now)."""
    for name in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
        if getattr(request, name):
            raise InvalidInputError(f"{name} is not supported by this server")
    tinker_params = request.sampling_params
    stop = tinker_params.stop
    stop_list = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    topk_prompt = request.topk_prompt_logprobs
    if request.prompt_logprobs_last_n is not None and not (request.prompt_logprobs or topk_prompt):
        raise InvalidInputError("prompt_logprobs_last_n needs prompt_logprobs=True")
    return SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if tinker_params.max_tokens is None else tinker_params.max_tokens,
        temperature=tinker_params.temperature,
        top_k=tinker_params.top_k,
        top_p=tinker_params.top_p,
        stop=stop_list,
        ignore_eos=stop is not None and not stop_list,  # Tinker: [] disables every stop, EOS included
        seed=tinker_params.seed,
        num_samples=request.num_samples,
        logprobs=request.topk_sample_logprobs or True,
        prompt_logprobs=topk_prompt or bool(request.prompt_logprobs),
    )


def sample(
    pool: ModelPool, adapter: str | None, tokens: list[int], params: SamplingParams, last_n: int | None
) -> bytes:
    response = pool.sample_adapter(adapter, [{"input_ids": tokens}], params)
    sequences = [
        SampledSeq(
            tokens=list(seq.tokens),
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            stop_reason="length" if seq.stop_reason == "length" else "stop",
            topk=seq.topk_logprobs if params.logprobs is not True else None,
        )
        for seq in response.sequences
    ]
    prompt_logprobs = topk_prompt = None
    if params.prompt_logprobs and response.prompt_logprobs is not None:  # asked for: present
        prompt_logprobs = _last_n(list(response.prompt_logprobs[0]), last_n, None)
        if params.prompt_logprobs is not True and response.topk_prompt_logprobs is not None:
            topk_prompt = _last_n(list(response.topk_prompt_logprobs[0]), last_n, None)
    return proto_result(encode_sample_response(sequences, prompt_logprobs, topk_prompt))


def sample_checkpoint(
    pool: ModelPool,
    adapter: str,
    directory: str,
    reload: bool,
    tokens: list[int],
    params: SamplingParams,
    last_n: int | None,
) -> bytes:
    """:func:`sample` a saved checkpoint's adapter, (re)loaded into this pool's sampler first if ``reload``."""
    if reload:
        pool.load_sampler_adapter(adapter, directory)
    return sample(pool, adapter, tokens, params, last_n)


def check_last_n(last_n: int | None, prompt_length: int) -> None:
    if last_n is not None and not 1 <= last_n <= prompt_length - 1:
        raise InvalidInputError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1, got {last_n}")


def _last_n(values: list[Any], last_n: int | None, blank: Any) -> list[Any]:
    """Only the last ``last_n`` positions scored (the SDK checks that the others are blank)."""
    if last_n is None:
        return values
    return [blank] * (len(values) - last_n) + values[-last_n:]
