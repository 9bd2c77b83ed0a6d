"""What a sampler back-end hands back, and how it becomes a :class:`SampleResponse`.

Back-ends only generate tokens (:class:`Completion`); turning them into text,
training features and the conversation a reward reads is shared here, so every
back-end returns the same thing for the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twinkle.data_format import (
    IGNORE_INDEX,
    InputFeature,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    StopReason,
    make_input_feature,
    prompt_major,
)
from twinkle.sampler.stopping import StopCriteria
from twinkle.sampler.vision import image_digest

TopK = list[tuple[int, float]]


@dataclass
class Prompt:
    """One input: its token ids, the adapter that samples it, and the validated feature (messages, user_data)."""

    input_ids: list[int]
    adapter: str | None
    feature: InputFeature

    @property
    def group_key(self) -> tuple[tuple[int, ...], str | None, str | None]:
        """Inputs with equal keys are the same prompt: one prefill, and one group of completions in the response.

        Prompts with images are equal only with equal images (a digest of their pixel values).
        """
        return tuple(self.input_ids), self.adapter, image_digest(self.feature)


@dataclass
class Completion:
    """One generated continuation, as a back-end produced it.

    ``routed_experts``: when recorded, every token's experts (prompt and completion, ``[T][layers][top_k]``).
    """

    tokens: list[int]
    stop_reason: StopReason
    logprobs: list[float] | None = None
    topk_logprobs: list[TopK] | None = None
    routed_experts: list[list[list[int]]] | None = None


@dataclass
class Generation:
    """A back-end's answer: ``num_samples`` consecutive completions per prompt in input order, prompt log-probs."""

    completions: list[Completion]
    prompt_logprobs: list[list[float | None]] | None = None
    topk_prompt_logprobs: list[list[TopK | None]] | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One checked sample call, as a back-end generates it: its prompts, parameters and stops."""

    prompts: list[Prompt]
    params: SamplingParams
    stop: StopCriteria

    @property
    def completion_count(self) -> int:
        return len(self.prompts) * self.params.num_samples


def build_response(prompts: list[Prompt], generation: Generation, stop: StopCriteria) -> SampleResponse:
    """Attach text, the conversation and a ready-to-train feature to every completion, prompt-major.

    ``generation`` holds ``num_samples`` completions per input in input order;
    the response lists identical prompts' completions together
    (:func:`twinkle.data_format.prompt_major`: ``[p0, p1, p0, p1]`` answers as
    inputs ``0, 2, 1, 3``), each recording the input it answers.
    """
    num_samples = len(generation.completions) // len(prompts)
    sequences = []
    for input_index in prompt_major([prompt.group_key for prompt in prompts]):
        prompt = prompts[input_index]
        for completion in generation.completions[input_index * num_samples : (input_index + 1) * num_samples]:
            text = stop.visible_text(completion.tokens)
            sequences.append(
                SampledSequence(
                    tokens=completion.tokens,
                    stop_reason=completion.stop_reason,
                    logprobs=completion.logprobs,
                    topk_logprobs=completion.topk_logprobs,
                    decoded=text,
                    new_input_feature=_training_feature(prompt, completion, text),
                    input_index=input_index,
                    adapter_name=prompt.adapter,
                )
            )
    return SampleResponse(
        sequences=sequences,
        prompt_token_ids=[prompt.input_ids for prompt in prompts],
        prompt_logprobs=generation.prompt_logprobs,
        topk_prompt_logprobs=generation.topk_prompt_logprobs,
    )


def _training_feature(prompt: Prompt, completion: Completion, text: str) -> InputFeature:
    """Prompt + completion, labels on the completion only; the conversation ends with the completion.

    A prompt encoded for generation may still carry the reference answer as
    trailing assistant messages (they were not rendered); those are replaced,
    so ``messages[-1]`` is always what the model said — the turn rewards score.
    """
    extra: dict[str, Any] = {}
    messages = prompt.feature.get("messages")
    if messages is not None:
        end = len(messages)
        while end and messages[end - 1].get("role") == "assistant":
            end -= 1
        extra["messages"] = [*messages[:end], {"role": "assistant", "content": text}]
    if prompt.feature.get("user_data") is not None:
        extra["user_data"] = prompt.feature["user_data"]
    if completion.routed_experts is not None:
        extra["routed_experts"] = completion.routed_experts
    tokens = completion.tokens
    if prompt.feature.get("pixel_values") is not None:  # the images the completion was sampled from
        extra["pixel_values"] = prompt.feature["pixel_values"]
        extra["image_grid_thw"] = prompt.feature["image_grid_thw"]
        extra["mm_token_type_ids"] = [*prompt.feature["mm_token_type_ids"], *[0] * len(tokens)]
    labels = [IGNORE_INDEX] * len(prompt.input_ids) + tokens
    return make_input_feature(prompt.input_ids + tokens, labels, **extra)
