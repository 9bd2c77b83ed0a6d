"""``vLLMSampler``: the :class:`~twinkle.sampler.Sampler` interface served by vLLM's offline engine (GPU).

Inputs, adapters, stops and results go through the same shared code as
:class:`~twinkle.sampler.TorchSampler`; vLLM only generates tokens. Adapters
are handed to vLLM as PEFT directories through ``LoRARequest``s: one given as
tensors is written to a private temporary directory first. vLLM identifies an
adapter by its request name, so every new version gets a fresh name
(``name@version``) and the old one is unloaded. Log-probs are vLLM's
``raw_logprobs`` (the model's distribution before any sampling transform),
the same quantity TorchSampler and the trainer compute.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from twinkle.data_format import SamplingParams, StopReason
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.hub import resolve_model
from twinkle.infra import DeviceMesh, remote_class
from twinkle.module import ADAPTER_CONFIG, check_lora_config, split_lora_state_dict, write_adapter_dir
from twinkle.registry import register
from twinkle.sampler.base import Sampler
from twinkle.sampler.results import Completion, Generation, Prompt, TopK
from twinkle.sampler.stopping import StopCriteria
from twinkle.sampler.token_sampling import requested, topk_count
from twinkle.utils import require


@register("sampler")
@remote_class
class vLLMSampler(Sampler):
    """Samples with ``vllm.LLM(model=<resolved model_id>, **engine_args)``.

    Pass ``engine_args={'enable_lora': True, 'max_lora_rank': r}`` to serve
    adapters. ``logprobs_mode`` defaults to ``'raw_logprobs'``.
    """

    def __init__(
        self,
        model_id: str | None = None,
        engine_args: Mapping[str, Any] | None = None,
        device_mesh: DeviceMesh | None = None,
    ) -> None:
        vllm = require("vllm", "twinkle-sampler[vllm]", "vLLMSampler")
        super().__init__(resolve_model(model_id))
        self.device_mesh = device_mesh
        self.engine_args = {"logprobs_mode": "raw_logprobs", **(engine_args or {})}
        self.llm = vllm.LLM(model=self.model_path, **self.engine_args)
        self._lora_requests: dict[str, Any] = {}
        self._versions = 0
        self._adapter_root = Path(tempfile.mkdtemp(prefix="twinkle-vllm-adapters-"))
        weakref.finalize(self, shutil.rmtree, self._adapter_root, True)

    @property
    def vocab_size(self) -> int:
        return self.llm.llm_engine.model_config.get_vocab_size()

    @property
    def max_model_len(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def adapter_names(self) -> list[str]:
        return sorted(self._lora_requests)

    def add_adapter(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write the adapter as a PEFT directory that vLLM loads on first use; replaces one of that name."""
        split_lora_state_dict(name, config, state_dict)  # refuse what vLLM would misread, before writing
        self._require_lora(name)
        directory = Path(tempfile.mkdtemp(dir=self._adapter_root))
        write_adapter_dir(directory, config, state_dict)
        self._register(name, directory)

    def load_adapter(self, name: str, path: str | Path) -> None:
        config_file = Path(path) / ADAPTER_CONFIG
        if not config_file.is_file():
            raise InvalidInputError(f"{path} is not a saved LoRA adapter: {ADAPTER_CONFIG} is missing")
        check_lora_config(name, json.loads(config_file.read_text()))
        self._require_lora(name)
        self._register(name, Path(path))

    def remove_adapter(self, name: str) -> None:
        if name not in self._lora_requests:
            raise InvalidInputError(f"unknown adapter {name!r}; adapters: {self.adapter_names}")
        self._unload(self._lora_requests.pop(name))

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's cached prompt prefixes (their KV entries are stale once base weights change)."""
        self.llm.reset_prefix_cache()

    def _require_lora(self, name: str) -> None:
        if not self.engine_args.get("enable_lora"):
            raise ConfigurationError(
                f"cannot serve adapter {name!r}: create vLLMSampler with "
                "engine_args={'enable_lora': True, 'max_lora_rank': <the largest rank>}"
            )

    def _register(self, name: str, path: Path) -> None:
        from vllm.lora.request import LoRARequest

        self._versions += 1
        previous = self._lora_requests.get(name)
        self._lora_requests[name] = LoRARequest(f"{name}@{self._versions}", self._versions, str(path))
        if previous is not None:
            self._unload(previous)

    def _unload(self, request: Any) -> None:
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        path = Path(request.lora_path)
        if path.parent == self._adapter_root:  # written by add_adapter, not the user's directory
            shutil.rmtree(path, ignore_errors=True)

    def _generate(self, prompts: list[Prompt], params: SamplingParams, stop: StopCriteria) -> Generation:
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=prompt.input_ids) for prompt in prompts]
        loras = [None if prompt.adapter is None else self._lora_requests[prompt.adapter] for prompt in prompts]
        outputs = self.llm.generate(requests, _vllm_params(params, stop), lora_request=loras, use_tqdm=False)
        k = topk_count(params.logprobs)
        generation = Generation(
            completions=[
                _completion(sample, requested(params.logprobs), k) for output in outputs for sample in output.outputs
            ]
        )
        if requested(params.prompt_logprobs):
            prompt_k = topk_count(params.prompt_logprobs)
            per_prompt = [
                _prompt_logprobs(prompt.input_ids, output.prompt_logprobs, prompt_k)
                for prompt, output in zip(prompts, outputs, strict=True)
            ]
            generation.prompt_logprobs = [logprobs for logprobs, _ in per_prompt]
            generation.topk_prompt_logprobs = [alternatives for _, alternatives in per_prompt] if prompt_k else None
        return generation


def _vllm_params(params: SamplingParams, stop: StopCriteria) -> Any:
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


def _completion(sample: Any, with_logprobs: bool, k: int) -> Completion:
    """One vLLM ``CompletionOutput``: per position, a dict ``{token_id: Logprob}`` holding the sampled token."""
    tokens = list(sample.token_ids)
    reason: StopReason = sample.finish_reason if sample.finish_reason in ("stop", "length") else "abort"
    completion = Completion(tokens, reason)
    if with_logprobs:
        completion.logprobs = [position[token].logprob for token, position in zip(tokens, sample.logprobs, strict=True)]
    if k:
        completion.topk_logprobs = [_top(position, k) for position in sample.logprobs]
    return completion


def _prompt_logprobs(ids: list[int], positions: list[Any], k: int) -> tuple[list[float | None], list[TopK | None]]:
    logprobs: list[float | None] = [None]
    alternatives: list[TopK | None] = [None]
    for token, position in zip(ids[1:], positions[1:], strict=True):
        logprobs.append(position[token].logprob)
        alternatives.append(_top(position, k))
    return logprobs, alternatives


def _top(position: Mapping[int, Any], k: int) -> TopK:
    """The ``k`` best alternatives of one position, most likely first (vLLM adds the sampled token if outside)."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(token, entry.logprob) for token, entry in ranked[:k]]
