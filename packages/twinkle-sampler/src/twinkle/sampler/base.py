"""``Sampler``: what every sampling back-end shares — inputs, adapters per prompt, stops and results.

A back-end implements :meth:`Sampler._generate` (token ids in, token ids and
log-probs out, for several calls at once) and adapter management; everything a
user can get wrong is checked here first, before any compute, and every
back-end returns the same :class:`SampleResponse` for the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from twinkle.data_format import (
    InputFeature,
    SampleCall,
    SampleResponse,
    SampleResult,
    SamplingParams,
    Trajectory,
    validate_input_feature,
)
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.registry import build
from twinkle.sampler.results import Generation, GenerationRequest, Prompt, build_response
from twinkle.sampler.stopping import StopCriteria

AdapterSpec = str | None | Sequence[str | None]


class Sampler(ABC):
    """Generates completions for prompts (core's ``Sampler`` protocol), with a LoRA adapter per prompt.

    ``inputs`` are encoded prompts (``InputFeature``, e.g. from
    ``dataset.encode(add_generation_prompt=True)``) or trajectories, which the
    template set by :meth:`set_template` encodes with the generation prompt.
    """

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.template: Any = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._model_eos_ids = _generation_config_eos_ids(Path(model_path))

    # ------------------------------------------------------------------ set-up

    def set_template(self, template: Any, **kwargs: Any) -> None:
        """Use ``template`` (instance, class or registered name) to encode trajectories and decode completions.

        ``model_id`` defaults to this sampler's model when the template is built here.
        """
        if isinstance(template, (str, type)):
            kwargs.setdefault("model_id", self.model_path)
        self.template = build("template", template, **kwargs)
        self._tokenizer = getattr(self.template, "tokenizer", None)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The template's tokenizer, else the model's own (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids the model can embed (prompt ids must be below it)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest sequence (prompt + completion) the model can attend over."""

    @property
    @abstractmethod
    def adapter_names(self) -> list[str]:
        """The LoRA adapters that can be named in :meth:`sample`."""

    @abstractmethod
    def add_adapter(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Serve LoRA adapter ``name`` (``LoraConfig`` or its dict, PEFT-format weights), replacing one of that name."""

    @abstractmethod
    def load_adapter(self, name: str, path: str | Path) -> None:
        """Serve the LoRA adapter saved (PEFT format) in directory ``path`` as ``name``."""

    @abstractmethod
    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` and free its memory."""

    # ------------------------------------------------------------------ sampling

    def sample(
        self,
        inputs: InputFeature | Trajectory | Sequence[InputFeature | Trajectory],
        sampling_params: SamplingParams | None = None,
        adapter_name: AdapterSpec = None,
        num_samples: int | None = None,
        use_base_model: bool = False,
    ) -> SampleResponse:
        """Sample ``num_samples`` completions per input (default ``sampling_params.num_samples``), prompt-major.

        Which weights sample:

        - ``adapter_name='name'``: that LoRA adapter, for every input; a list
          gives one entry per input, ``None`` entries meaning the base model;
        - omitted: the sampler's **only** adapter (the one
          ``CheckpointEngineManager.sync_weights`` put there), the base model
          when it serves none, and an error naming them when it serves several;
        - ``use_base_model=True``: the bare base model, whatever adapters it serves.

        The response is prompt-major: inputs with the same prompt token ids and
        adapter form one group, so ``sample(prompts * G)`` lists each prompt's
        ``G`` completions together exactly as ``sample(prompts, num_samples=G)``
        does, and ``GRPOAdvantage(...)(rewards, num_generations=G)`` groups them
        right. Groups come in order of first appearance; ``sequence.input_index``
        maps each completion back to its input.

        Each sequence has its tokens, raw log-probs (see
        :mod:`twinkle.sampler.token_sampling`), text, stop reason and
        ``new_input_feature``: prompt + completion, labelled on the completion,
        carrying the conversation (ending with the completion) and ``user_data``
        for rewards.
        """
        request = self._prepare(inputs, sampling_params, adapter_name, num_samples, use_base_model)
        (generation,) = self._generate([request])
        return build_response(request.prompts, generation, request.stop)

    def sample_many(self, calls: Sequence[SampleCall]) -> list[SampleResult]:
        """Several :meth:`sample` calls generated together (one batch: e.g. many tenants' calls on a server).

        Each call gets what :meth:`sample` would give it alone: its own parameters, stops, adapters and, with a
        ``seed``, its own random numbers. A call that fails its checks gets its error and the others still run;
        an error while generating is every call's.
        """
        results = [SampleResult() for _ in calls]
        checked: list[tuple[SampleResult, GenerationRequest]] = []
        for result, call in zip(results, calls, strict=True):
            try:
                request = self._prepare(
                    call.inputs, call.sampling_params, call.adapter_name, call.num_samples, call.use_base_model
                )
            except Exception as exc:  # this call's problem only: the rest of the batch runs
                result.error = exc
            else:
                checked.append((result, request))
        if not checked:
            return results
        try:
            generations = self._generate([request for _, request in checked])
        except Exception as exc:
            for result, _ in checked:
                result.error = exc
            return results
        for (result, request), generation in zip(checked, generations, strict=True):
            result.output = build_response(request.prompts, generation, request.stop)
        return results

    def _prepare(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None,
        adapter_name: AdapterSpec,
        num_samples: int | None,
        use_base_model: bool,
    ) -> GenerationRequest:
        """:meth:`sample`'s arguments checked: the prompts with their adapters, the parameters, the stops."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if num_samples is not None:
            params = dataclasses.replace(params, num_samples=num_samples)  # validates it
        prompts = self._prompts(inputs, adapter_name, use_base_model)
        stop = self._stop_criteria(params)
        self._check_lengths(prompts, params)
        self._check_prompts(prompts)
        return GenerationRequest(prompts, params, stop)

    def close(self) -> None:  # noqa: B027 (optional: most back-ends hold nothing but memory)
        """Free what the back-end holds beyond memory (an engine's processes and threads); nothing by default."""

    @abstractmethod
    def _generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """For each request, ``params.num_samples`` consecutive completions per prompt, prompts in input order."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text a user sees for ``token_ids`` (special tokens such as end-of-turn left out)."""
        if self.template is not None:
            return self.template.decode(token_ids, skip_special_tokens=True)
        # one sequence of ids decodes to one str (the stub's list[str] is for a batch)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)  # type: ignore[return-value]

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end every completion: the tokenizer's, the model's generation config's and the template's."""
        ids = [*self._model_eos_ids, *getattr(self.template, "eos_token_ids", [])]
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return list(dict.fromkeys(ids))

    # ------------------------------------------------------------------ input checks

    def _prompts(self, inputs: Any, adapter_name: AdapterSpec, use_base_model: bool) -> list[Prompt]:
        if isinstance(inputs, Mapping):
            inputs = [inputs]
        if not isinstance(inputs, Sequence) or isinstance(inputs, (str, bytes)):
            raise InvalidInputError(f"inputs must be a list of InputFeature or Trajectory dicts, got {inputs!r:.80}")
        if not inputs:
            raise InvalidInputError("inputs is empty: pass at least one prompt")
        adapters = self._adapters(adapter_name, len(inputs), use_base_model)
        prompts = []
        for index, item in enumerate(inputs):
            feature = self._encode(item, index)
            prompts.append(Prompt(feature["input_ids"], adapters[index], feature))
        return prompts

    def _encode(self, item: Any, index: int) -> InputFeature:
        where = f"inputs[{index}]"
        if isinstance(item, Mapping) and "input_ids" not in item and "messages" in item:
            if self.template is None:
                raise ConfigurationError(f"{where} is a trajectory; call set_template(...) so it can be encoded")
            encoded = self.template.encode(item, add_generation_prompt=True)
            if encoded is None:
                raise InvalidInputError(f"{where} was dropped by the template's truncation strategy")
            item = encoded
        return validate_input_feature(item, where=where, vocab_size=self.vocab_size)

    def _adapters(self, adapter_name: AdapterSpec, count: int, use_base_model: bool) -> list[str | None]:
        """The adapter of every input (``None``: the base model); see :meth:`sample`."""
        if not isinstance(use_base_model, bool):
            raise InvalidInputError(f"use_base_model must be True or False, got {use_base_model!r}")
        if use_base_model:
            if adapter_name is not None:
                raise InvalidInputError(
                    f"use_base_model=True samples without any adapter: do not also pass adapter_name={adapter_name!r}"
                )
            return [None] * count
        if adapter_name is None:
            return [self._default_adapter()] * count
        names = [adapter_name] * count if isinstance(adapter_name, str) else adapter_name
        if not isinstance(names, Sequence) or len(names) != count:
            raise InvalidInputError(
                f"adapter_name must be a name, None, or a list with one entry per input ({count}), got {adapter_name!r}"
            )
        known = set(self.adapter_names)
        for index, name in enumerate(names):
            if name is not None and name not in known:
                raise InvalidInputError(
                    f"unknown adapter {name!r} (inputs[{index}]); adapters: {sorted(known)}. Add it with add_adapter"
                )
        return list(names)

    def _default_adapter(self) -> str | None:
        """What a sample without ``adapter_name`` uses: the only adapter served, else the base model."""
        served = self.adapter_names
        if len(served) > 1:
            raise InvalidInputError(
                f"this sampler serves several adapters {served}: pass adapter_name=<one of them> (or a list, one "
                "per input), or use_base_model=True for the base model"
            )
        return served[0] if served else None

    def _check_prompts(self, prompts: list[Prompt]) -> None:  # noqa: B027 (optional: a back-end's own limits)
        """Refuse prompts this back-end cannot sample (checked with the rest, before any call of a batch runs)."""

    def _check_lengths(self, prompts: list[Prompt], params: SamplingParams) -> None:
        for index, prompt in enumerate(prompts):
            if len(prompt.input_ids) + params.max_tokens > self.max_model_len:
                raise InvalidInputError(
                    f"inputs[{index}] has {len(prompt.input_ids)} tokens: with max_tokens={params.max_tokens} it "
                    f"exceeds the model's {self.max_model_len}-token context; shorten it or lower max_tokens"
                )

    def _stop_criteria(self, params: SamplingParams) -> StopCriteria:
        strings = [item for item in params.stop if isinstance(item, str)]
        ids = [item for item in params.stop if not isinstance(item, str)]
        for token_id in ids:
            if token_id >= self.vocab_size:
                raise InvalidInputError(
                    f"SamplingParams.stop id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        for text in strings:
            length = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if length > params.max_tokens:
                raise InvalidInputError(
                    f"stop string {text!r} is {length} tokens long but max_tokens={params.max_tokens}: "
                    "it could never be generated in full"
                )
        eos_ids = [] if params.ignore_eos else self.eos_token_ids
        return StopCriteria([*eos_ids, *ids], strings, self.decode)


def _generation_config_eos_ids(model_dir: Path) -> list[int]:
    """End-of-sequence ids from the model's ``generation_config.json`` (several for chat models)."""
    config = model_dir / "generation_config.json"
    if not config.is_file():
        return []
    eos = json.loads(config.read_text()).get("eos_token_id")
    return [] if eos is None else eos if isinstance(eos, list) else [eos]
