"""Batched multi-turn rollouts: every live episode's next assistant turn sampled in one ``sample`` call per turn.

An episode is kept as token ids, never re-rendered: the model's sampled tokens
(trained, with the sampler's log-probs) and the environment's turns (rendered
by the chat template after them, not trained) are appended in order. What the
trainer sees is therefore exactly what the sampler conditioned on, so the
trainer's log-probs of the model's tokens equal the sampler's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from twinkle.data_format import IGNORE_INDEX, InputFeature, Message, SamplingParams, Trajectory, make_input_feature
from twinkle.env.group import EnvGroup
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Env, Sampler, Template

EpisodeEnd = Literal["done", "max_turns", "max_tokens"]


class RolloutTemplate(Template, Protocol):
    """A template that also parses completions and continues them token-exactly (``twinkle.template.Template``)."""

    eos_token_ids: list[int]

    def encode_turns(
        self, history: Sequence[Any], turns: Sequence[Any], tools: list[Any] | None = None
    ) -> list[int]: ...

    def parse_response(self, text: str) -> Message: ...


@dataclass
class Episode:
    """One finished rollout.

    ``model_mask`` is 1 on the tokens the model sampled, 0 on the prompt and
    the environment's turns; ``logprobs`` holds the sampler's log-prob of each
    model token, in order. ``end`` says why it stopped: the environment was
    ``done``, or the ``max_turns`` / ``max_tokens`` budget ran out (reward so far kept).
    """

    input_ids: list[int]
    model_mask: list[int]
    logprobs: list[float]
    messages: list[Message]
    reward: float = 0.0
    num_turns: int = 0
    num_tool_calls: int = 0
    end: EpisodeEnd = "done"
    info: dict[str, Any] = field(default_factory=dict)

    def to_input_feature(self) -> InputFeature:
        """Labelled on the model's tokens only; train it with ``old_logps=episode.logprobs``."""
        labels = [
            token if trained else IGNORE_INDEX for token, trained in zip(self.input_ids, self.model_mask, strict=True)
        ]
        return make_input_feature(self.input_ids, labels, messages=self.messages)


@dataclass
class _Live:
    env: Env
    episode: Episode
    budget: int  # the longest input_ids may grow


def rollout(
    sampler: Sampler,
    template: RolloutTemplate,
    envs: Sequence[EnvGroup | Env],
    sampling_params: SamplingParams | None = None,
    *,
    max_turns: int = 8,
    max_tokens: int = 2048,
    adapter_name: str | None = None,
    seed: int = 0,
) -> list[Episode]:
    """Play every environment to its end; one :class:`Episode` each, in order (a group's together).

    ``sampling_params.max_tokens`` caps one assistant turn, ``max_tokens`` a
    whole episode (prompt included) and ``max_turns`` its assistant turns.
    An :class:`EnvGroup` resets all its copies with its seed; a bare
    :class:`Env` at position ``i`` gets ``seed + i``.
    """
    params = sampling_params if sampling_params is not None else SamplingParams()
    if params.num_samples != 1:
        raise InvalidInputError("rollout samples one continuation per episode: use an EnvGroup for several")
    for name, value in (("max_turns", max_turns), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    live = [_start(env, env_seed, template, max_tokens) for env, env_seed in _flatten(envs, seed)]
    episodes = [state.episode for state in live]
    for turn in range(max_turns):
        live = [state for state in live if state.budget > len(state.episode.input_ids)]
        if not live:
            break
        turn_params = dataclasses.replace(
            params, max_tokens=min(params.max_tokens, max(s.budget - len(s.episode.input_ids) for s in live))
        )
        prompts = [make_input_feature(state.episode.input_ids) for state in live]
        response = sampler.sample(prompts, turn_params, adapter_name=adapter_name)
        by_input = {sequence.input_index: sequence for sequence in response.sequences}  # the response is prompt-major
        sequences = [by_input[index] for index in range(len(live))]
        live = [
            state
            for state, sequence in zip(live, sequences, strict=True)
            if _advance(state, sequence, template, last_turn=turn == max_turns - 1)
        ]
    for state in live:
        state.episode.end = "max_turns"
    return episodes


def _flatten(envs: Sequence[EnvGroup | Env], seed: int) -> list[tuple[Env, int]]:
    if not envs:
        raise InvalidInputError("envs is empty: pass at least one Env or EnvGroup")
    flat: list[tuple[Env, int]] = []
    for index, item in enumerate(envs):
        if isinstance(item, EnvGroup):
            flat.extend((env, item.seed) for env in item.envs)
        elif isinstance(item, Env):
            flat.append((item, seed + index))
        else:
            raise InvalidInputError(f"envs[{index}] must be an Env or an EnvGroup, got {type(item).__name__}")
    return flat


def _start(env: Env, seed: int, template: RolloutTemplate, max_tokens: int) -> _Live:
    messages = list(env.reset(seed))
    trajectory: Trajectory = {"messages": messages}
    if env.tools:
        trajectory["tools"] = list(env.tools)
    feature = template.encode(trajectory, add_generation_prompt=True)
    if feature is None:
        raise InvalidInputError("the template dropped an environment's opening prompt (too long for it)")
    ids = list(feature["input_ids"])
    if len(ids) >= max_tokens:
        raise InvalidInputError(f"an opening prompt has {len(ids)} tokens, leaving none of max_tokens={max_tokens}")
    return _Live(env, Episode(ids, [0] * len(ids), [], messages), max_tokens)


def _advance(state: _Live, sequence: Any, template: RolloutTemplate, last_turn: bool) -> bool:
    """Append the sampled turn and the environment's answer; whether the episode goes on."""
    episode = state.episode
    tokens = list(sequence.tokens)[: state.budget - len(episode.input_ids)]
    episode.input_ids += tokens
    episode.model_mask += [1] * len(tokens)
    episode.logprobs += list(sequence.logprobs or [])[: len(tokens)]
    episode.num_turns += 1
    if sequence.stop_reason != "stop" or len(tokens) < len(sequence.tokens):  # cut: nothing sound to answer
        episode.end = "max_tokens"
        return False
    if tokens[-1] not in template.eos_token_ids:  # a stop string ended the turn: close it, untrained
        episode.input_ids.append(template.eos_token_ids[0])
        episode.model_mask.append(0)
    action = template.parse_response(template.decode(tokens))
    episode.messages.append(action)
    episode.num_tool_calls += len(action.get("tool_calls") or [])
    step = state.env.step(action)
    episode.reward += step.reward
    episode.info = step.info
    if step.done or last_turn:
        return not step.done
    if not step.messages:
        raise InvalidInputError(
            f"{type(state.env).__name__}.step returned no messages for an episode that is not done; "
            "answer the turn (or end the episode with done=True)"
        )
    turn_ids = template.encode_turns(episode.messages, step.messages, list(state.env.tools) or None)
    episode.messages += step.messages
    episode.input_ids += turn_ids
    episode.model_mask += [0] * len(turn_ids)
    if len(episode.input_ids) >= state.budget:
        episode.end = "max_tokens"
        return False
    return True
