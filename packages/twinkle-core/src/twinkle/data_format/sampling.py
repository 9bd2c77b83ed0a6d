"""Sampling requests and results: :class:`SamplingParams`, :class:`SampledSequence`, :class:`SampleResponse`, and
:class:`SampleCall` / :class:`SampleResult` (one call of several sampled together: ``Sampler.sample_many``)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from twinkle.data_format.input_feature import InputFeature
from twinkle.data_format.message import Trajectory
from twinkle.data_format.serde import Serializable
from twinkle.errors import InvalidInputError

StopReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams(Serializable):
    """How to sample. Defaults follow common practice (vLLM / Tinker).

    ``top_k=-1`` and ``top_p=1.0`` disable those filters; ``temperature=0`` is greedy.
    ``logprobs`` asks for the sampled tokens' log-probabilities; an int ``k > 0``
    also returns the top-k alternatives. ``stop`` holds strings and/or token ids;
    the model's end-of-sequence tokens always stop too, unless ``ignore_eos``.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: list[str | int] = field(default_factory=list)
    seed: int | None = None
    num_samples: int = 1
    logprobs: bool | int = True
    prompt_logprobs: bool | int = False
    repetition_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, (str, int)):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise InvalidInputError(f"SamplingParams.{message}")

        need(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an int >= 1, got {self.max_tokens!r}",
        )
        need(_is_num(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}")
        need(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 or >= 1, got {self.top_k!r}",
        )
        need(_is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(
            _is_int(self.num_samples) and self.num_samples >= 1,
            f"num_samples must be an int >= 1, got {self.num_samples!r}",
        )
        need(
            self.seed is None or (_is_int(self.seed) and self.seed >= 0),
            f"seed must be a non-negative int, got {self.seed!r}",
        )
        need(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty must be > 0")
        need(isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(isinstance(value, bool) or (_is_int(value) and value >= 0), f"{name} must be a bool or an int >= 0")
        for item in self.stop:
            if isinstance(item, str):
                need(item != "", "stop strings must not be empty")
            else:
                need(_is_int(item) and item >= 0, f"stop entries must be strings or token ids, got {item!r}")


@dataclass
class SampledSequence(Serializable):
    """One completion: token ids, their log-probs, the text, and a feature ready for training.

    ``new_input_feature`` is prompt + completion with labels on the completion only,
    so it can go straight into ``forward_backward``. ``input_index`` is the
    position, in the ``inputs`` of the ``sample`` call, of the prompt it answers;
    ``adapter_name`` the adapter that sampled it (``None``: the base model).
    """

    tokens: list[int]
    stop_reason: StopReason
    logprobs: list[float] | None = None
    topk_logprobs: list[list[tuple[int, float]]] | None = None
    decoded: str | None = None
    new_input_feature: InputFeature | None = None
    input_index: int | None = None
    adapter_name: str | None = None


@dataclass
class SampleResponse(Serializable):
    """All completions for one request, prompt-major: each distinct prompt's completions together.

    Inputs with the same prompt token ids and the same adapter form one group
    (``sample(prompts * G)`` groups like ``sample(prompts, num_samples=G)``);
    groups come in order of first appearance, and within a group each input's
    ``num_samples`` completions follow in input order. ``sequences[i].input_index``
    maps a completion back to its input; the prompt-level lists
    (``prompt_token_ids``, ``prompt_logprobs``) follow the inputs' order.
    """

    sequences: list[SampledSequence]
    prompt_token_ids: list[list[int]] | None = None
    prompt_logprobs: list[list[float | None]] | None = None
    topk_prompt_logprobs: list[list[list[tuple[int, float]] | None]] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleResponse:
        data = dict(data)
        data["sequences"] = [SampledSequence.from_dict(s) for s in data.get("sequences", [])]
        return super().from_dict(data)

    @classmethod
    def concatenate(cls, parts: Sequence[SampleResponse]) -> SampleResponse:
        """One response for consecutive shares of one call's inputs (several sampler workers), prompt-major again.

        Each part indexes its own share; the result indexes the whole call, and
        a prompt that several shares hold is one group, as if one sampler had
        sampled every input.
        """
        sequences: list[SampledSequence] = []
        prompt_ids: list[list[int]] = []
        for part in parts:
            if part.prompt_token_ids is None or any(s.input_index is None for s in part.sequences):
                raise InvalidInputError(
                    "SampleResponse.concatenate: every part needs prompt_token_ids and an input_index on every "
                    "sequence (twinkle.sampler.Sampler's responses have both)"
                )
            offset = len(prompt_ids)  # below: no input_index is None (checked above; mypy cannot see into any())
            sequences.extend(replace(s, input_index=offset + s.input_index) for s in part.sequences)  # type: ignore[operator]
            prompt_ids.extend(part.prompt_token_ids)
        order = prompt_major([(tuple(prompt_ids[s.input_index]), s.adapter_name) for s in sequences])  # type: ignore[index]
        return cls(
            sequences=[sequences[i] for i in order],
            prompt_token_ids=prompt_ids,
            prompt_logprobs=_joined([part.prompt_logprobs for part in parts]),
            topk_prompt_logprobs=_joined([part.topk_prompt_logprobs for part in parts]),
        )


def prompt_major(keys: Sequence[Hashable]) -> list[int]:
    """The indices of ``keys``, equal keys together: groups in order of first appearance, members in order.

    ``['a', 'b', 'a', 'b']`` gives ``[0, 2, 1, 3]``: the order of a :class:`SampleResponse`, whose keys are
    each completion's prompt token ids and adapter.
    """
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return [index for members in groups.values() for index in members]


def _joined(lists: Sequence[list[Any] | None]) -> list[Any] | None:
    """Per-input lists of consecutive shares, joined; ``None`` when the shares have none."""
    if any(values is None for values in lists):
        return None
    return [value for values in lists for value in values]  # type: ignore[union-attr]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SampleCall:
    """The arguments of one ``Sampler.sample`` call, for ``Sampler.sample_many`` (which samples several together).

    ``adapter_name`` is a name, ``None``, or one entry per input (in-process samplers; a remote one takes one).
    """

    inputs: InputFeature | Trajectory | Sequence[InputFeature | Trajectory]
    sampling_params: SamplingParams | None = None
    adapter_name: str | Sequence[str | None] | None = None
    num_samples: int | None = None
    use_base_model: bool = False


@dataclass
class SampleResult:
    """What one call of ``Sampler.sample_many`` got: its response, or the error that stopped it."""

    output: SampleResponse | None = None
    error: Exception | None = None

    def unwrap(self) -> SampleResponse:
        """The response, or the call's error raised."""
        if self.error is not None:
            raise self.error
        assert self.output is not None  # a call without an error always has its response
        return self.output
