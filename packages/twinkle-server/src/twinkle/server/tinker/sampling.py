"""Tinker's ``asample``: its request mapped onto Twinkle's sampler, and the reply in the SDK's protobuf."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from twinkle.data_format import SampleResponse, SamplingParams
from twinkle.errors import InvalidInputError
from twinkle.server.tinker.codec import model_input_from_json
from twinkle.server.tinker.images import WireImage, expanded
from twinkle.server.tinker.replies import proto_result

DEFAULT_MAX_TOKENS = 256
TOPK_EMPTY = (0, -99999.0)  # (token id, logprob) of an unused top-k cell, as the SDK reads it


@dataclass
class SampledSeq:
    """One sampled completion, as :func:`encode_sample_response` writes it."""

    tokens: list[int]
    logprobs: list[float] | None = None
    stop_reason: Literal["stop", "length"] = "stop"
    topk: Sequence[list[tuple[int, float]] | None] | None = None  # per position: up to k (id, logprob) pairs


def prompt_images(prompt: Any) -> tuple[np.ndarray, list[WireImage]]:
    """A ``ModelInput`` prompt's text tokens and its images (each at its offset among the tokens)."""
    return model_input_from_json(prompt.model_dump(mode="json"), "prompt")


def prompt_feature(tokens: np.ndarray, images: list[WireImage], model_path: str, model_id: str) -> dict[str, Any]:
    """The prompt as the sampler takes it: its tokens, with its images' vision tokens and pixel values."""
    input_ids, features = expanded(tokens, images, model_path, model_id, "prompt")
    return {"input_ids": input_ids.tolist(), **features}


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


def reply(response: SampleResponse, params: SamplingParams, last_n: int | None) -> bytes:
    """The SDK's reply to a sample request (one prompt, a feature of :func:`prompt_feature`)."""
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


def check_last_n(last_n: int | None, prompt_length: int) -> None:
    if last_n is not None and not 1 <= last_n <= prompt_length - 1:
        raise InvalidInputError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1, got {last_n}")


def _last_n(values: list[Any], last_n: int | None, blank: Any) -> list[Any]:
    """Only the last ``last_n`` positions scored (the SDK checks that the others are blank)."""
    if last_n is None:
        return values
    return [blank] * (len(values) - last_n) + values[-last_n:]


def encode_sample_response(
    sequences: Sequence[SampledSeq],
    prompt_logprobs: Sequence[float | None] | None = None,
    topk_prompt_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None = None,
    *,
    prompt_cache_hit_tokens: int = 0,
) -> bytes:
    """A ``SampleResponse``; ``None`` prompt log-probs (e.g. position 0) are sent as NaN, as the SDK expects."""
    out = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for index, seq in enumerate(sequences):
        where = f"sequences[{index}]"
        if seq.stop_reason not in ("stop", "length"):
            raise ValueError(f"{where}.stop_reason must be 'stop' or 'length', got {seq.stop_reason!r}")
        msg = out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
        )
        if seq.logprobs is not None:
            if len(seq.logprobs) != len(seq.tokens):
                raise ValueError(f"{where} has {len(seq.tokens)} tokens but {len(seq.logprobs)} logprobs")
            msg.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
        if seq.topk is not None:
            if len(seq.topk) != len(seq.tokens):
                raise ValueError(f"{where} has {len(seq.tokens)} tokens but top-k for {len(seq.topk)} positions")
            msg.topk_sampled_logprobs.CopyFrom(_topk(seq.topk, f"{where}.topk"))
    if prompt_logprobs is not None:
        values = [math.nan if value is None else float(value) for value in prompt_logprobs]
        out.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    if topk_prompt_logprobs is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(topk_prompt_logprobs, "topk_prompt_logprobs"))
    return out.SerializeToString()


def _topk(entries: Sequence[Sequence[tuple[int, float]] | None], where: str) -> pb.TopkLogprobs:
    """Dense ``[length, k]`` matrices with ``k`` the longest entry; missing cells hold :data:`TOPK_EMPTY`."""
    k = max((len(entry) for entry in entries if entry is not None), default=0)
    ids = np.full((len(entries), k), TOPK_EMPTY[0], dtype="<i4")
    logprobs = np.full((len(entries), k), TOPK_EMPTY[1], dtype="<f4")
    for position, entry in enumerate(entries):
        for rank, (token_id, logprob) in enumerate(entry or ()):
            ids[position, rank] = token_id
            logprobs[position, rank] = logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=logprobs.tobytes(), k=k, length=len(entries))
