"""``vLLMSampler``: the :class:`~twinkle.sampler.Sampler` interface served by vLLM's offline engine (GPU or CPU).

Inputs, adapters, stops and results go through the same shared code as
:class:`~twinkle.sampler.TorchSampler`; vLLM only generates tokens. Log-probs
are vLLM's ``raw_logprobs`` (the model's distribution before any sampling
transform) computed with the trainer's log-sum-exp
(:func:`~twinkle.sampler.vllm_engine.use_exact_logprobs`), so they equal the
trainer's ``forward_only`` log-probs to float32 rounding.

Adapters reach vLLM as ``LoRARequest``s of PEFT directories: one given as
tensors is written into the sampler's private temporary directory (removed
with the adapter, and with the sampler: :mod:`~twinkle.sampler.vllm_adapter_files`). Every new version gets a fresh
request id, so nothing cached for an old version (weights, prefixes) is used again.

**Base rows and adapters in one batch.** vLLM's CPU LoRA kernels give a base
row that shares a batch with adapters the adapter of the last slot (vLLM 0.32).
A self-test at start-up (:mod:`~twinkle.sampler.vllm_self_test`) finds out;
where it happens, every base row goes through an all-zero adapter instead,
which computes the base model exactly.

**Async engine.** ``async_engine=True`` runs vLLM's ``AsyncLLM`` instead of
``vllm.LLM`` (:mod:`twinkle.sampler.vllm_async`): concurrent :meth:`sample`
calls (threads, a server's requests) are batched by the engine, and
:meth:`sample_stream` yields tokens as they are generated. Streaming is
vLLMSampler's own, not the :class:`Sampler` interface's: TorchSampler decodes a
whole batch in lock-step inside one call and has no engine serving requests
as they come, which is what streaming is for.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from twinkle.data_format import InputFeature, SamplingParams, Trajectory
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.hub import resolve_model
from twinkle.infra import DeviceMesh, get_runtime, remote_class
from twinkle.module import read_adapter_dir, split_lora_state_dict
from twinkle.registry import register
from twinkle.sampler.base import AdapterSpec, Sampler
from twinkle.sampler.results import Generation, GenerationRequest, Prompt
from twinkle.sampler.token_sampling import requested, topk_count
from twinkle.sampler.vllm_adapter_files import AdapterFiles
from twinkle.sampler.vllm_async import AsyncEngine, SampleChunk
from twinkle.sampler.vllm_engine import (
    WORKER_EXTENSION,
    check_cpu_head_size,
    check_worker_extension,
    linear_layers,
    lora_target_suffixes,
    pack,
)
from twinkle.sampler.vllm_outputs import chunks, completion, prompt_logprobs, vllm_params
from twinkle.sampler.vllm_self_test import base_rows_get_adapters, probe_adapter
from twinkle.utils import require

# KV cache a CPU engine gets when neither engine_args nor VLLM_CPU_KVCACHE_SPACE sizes it (vLLM requires a size).
CPU_KV_CACHE_BYTES = 512 << 20


@register("sampler")
@remote_class
class vLLMSampler(Sampler):
    """Samples with ``vllm.LLM(model=<resolved model_id>, **engine_args)``.

    Pass ``engine_args={'enable_lora': True, 'max_lora_rank': r, 'max_loras': n}``
    to serve adapters; ``lora_target_modules`` defaults to every linear layer but
    the output layer. On a CPU, ``kv_cache_memory_bytes`` defaults to 512 MiB,
    and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the engine in this process.
    ``exact_logprobs=False`` keeps vLLM's own float32 ``log_softmax``.
    ``zero_adapter_for_base`` overrides the start-up self-test (see the module
    docstring): ``True`` always sends base rows through the zero adapter,
    ``False`` never does (wrong on an engine that fails the self-test).
    ``async_engine=True`` serves from vLLM's ``AsyncLLM`` (see the module
    docstring); :meth:`close` stops its engine process.
    """

    def __init__(
        self,
        model_id: str | None = None,
        engine_args: Mapping[str, Any] | None = None,
        device_mesh: DeviceMesh | None = None,
        exact_logprobs: bool = True,
        zero_adapter_for_base: bool | None = None,
        async_engine: bool = False,
    ) -> None:
        vllm = require("vllm", "twinkle-sampler[vllm]", "vLLMSampler")
        from vllm.platforms import current_platform

        super().__init__(resolve_model(model_id))
        check_cpu_head_size(self.model_path)
        self.device_mesh = device_mesh
        # Where the engine keeps the weights: its platform's device (weight syncs broadcast over NCCL to CUDA).
        self.device = torch.device("cpu" if current_platform.is_cpu() else current_platform.device_type)
        args = {"logprobs_mode": "raw_logprobs", "worker_extension_cls": WORKER_EXTENSION, **(engine_args or {})}
        check_worker_extension(args["worker_extension_cls"])
        self._layers = linear_layers(self.model_path) if args.get("enable_lora") else {}
        if self._layers:
            args.setdefault("lora_target_modules", lora_target_suffixes(self._layers))
        sized = "kv_cache_memory_bytes" in args or "VLLM_CPU_KVCACHE_SPACE" in os.environ
        if current_platform.is_cpu() and not sized:
            args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.engine_args = args
        self.async_engine = async_engine
        self.llm: Any = (
            AsyncEngine({"model": self.model_path, **args}) if async_engine else vllm.LLM(self.model_path, **args)
        )
        weakref.finalize(self, _shutdown, self.llm)
        if exact_logprobs:
            self.llm.collective_rpc("twinkle_use_exact_logprobs")
        self._served: dict[str, Any] = {}
        self._last_id = 0
        self._files = AdapterFiles()
        self._zero: Any = None
        self.base_rows_through_zero_adapter = False
        if self._layers:
            wrong = zero_adapter_for_base
            if wrong is None:
                slots = self._lora_config.max_loras
                wrong = base_rows_get_adapters(self.llm, self._layers, slots, self._request, self._unload)
            if wrong:
                self._zero = self._request("zero", *probe_adapter(self._layers, seed=None))
                self.base_rows_through_zero_adapter = True

    # ------------------------------------------------------------------ engine facts

    @property
    def vocab_size(self) -> int:
        return self.llm.llm_engine.model_config.get_vocab_size()

    @property
    def max_model_len(self) -> int:
        return self.llm.llm_engine.model_config.max_model_len

    @property
    def adapter_names(self) -> list[str]:
        return sorted(self._served)

    @property
    def _lora_config(self) -> Any:
        return self.llm.llm_engine.vllm_config.lora_config

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Serve ``name`` from a private copy of the tensors (a PEFT directory vLLM loads); replaces any old one."""
        self._check_servable(name, config, state_dict)
        self._serve(name, self._request(name, config, state_dict))

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter directory ``path`` as ``name`` (vLLM reads it from there)."""
        from vllm.lora.request import LoRARequest

        config, state_dict = read_adapter_dir(path)
        self._check_servable(name, config, state_dict)
        self._last_id += 1
        self._serve(name, LoRARequest(f"{name}@{self._last_id}", self._last_id, str(Path(path).resolve())))

    def remove_adapter(self, name: str) -> None:
        if name not in self._served:
            raise InvalidInputError(f"unknown adapter {name!r}; adapters: {self.adapter_names}")
        self._unload(self._served.pop(name))

    def _check_servable(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        tensors, _ = split_lora_state_dict(name, config, state_dict)
        if not self._layers:
            raise ConfigurationError(
                f"cannot serve adapter {name!r}: create vLLMSampler with "
                "engine_args={'enable_lora': True, 'max_lora_rank': <the largest rank>}"
            )
        unknown = [module for module in tensors if module not in self._layers]
        if unknown:
            raise ConfigurationError(
                f"adapter {name!r} targets {unknown[:3]}, which are not linear layers vLLM puts LoRA on in "
                f"{self.model_path} (the output layer is not one: train adapters without it, e.g. Tinker's "
                "create_lora_training_client(..., train_unembed=False))"
            )
        rank, limit = max(A.shape[0] for A, _ in tensors.values()), self._lora_config.max_lora_rank
        if rank > limit:
            raise ConfigurationError(
                f"adapter {name!r} has rank {rank}, above the engine's max_lora_rank={limit}; create vLLMSampler "
                f"with engine_args={{'max_lora_rank': <one of vLLM's sizes (8, 16, 32, ...) >= {rank}>, ...}}"
            )

    def _request(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> Any:
        """A LoRARequest with a fresh id for the adapter, written into this sampler's private directory."""
        from vllm.lora.request import LoRARequest

        directory = self._files.write(config, state_dict)
        self._last_id += 1
        return LoRARequest(f"{name}@{self._last_id}", self._last_id, str(directory))

    def _serve(self, name: str, request: Any) -> None:
        previous = self._served.get(name)
        self._served[name] = request
        if previous is not None:
            self._unload(previous)
            self.reset_prefix_cache()

    def _unload(self, request: Any) -> None:
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        self._files.remove(request.lora_path)

    # ------------------------------------------------------------------ weights and engine state

    def load_base_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load tensors named as in the Hugging Face checkpoint into the engine's base weights; returns how many.

        Names and shapes are checked against the checkpoint before anything is
        loaded; then vLLM's ``reload_weights`` loads them, a tied output layer
        follows the new embedding, and the prefix cache is reset. Adapters stay.
        """
        shapes, tied = _checkpoint_shapes(self.model_path)
        embedding = next((key for key in shapes if key.endswith("embed_tokens.weight")), None) if tied else None
        items = weights.items() if isinstance(weights, Mapping) else weights
        checked: list[tuple[str, torch.Tensor]] = []
        for key, tensor in items:
            # a tied output layer's weight is the embedding, which the checkpoint holds under its own name only
            name = embedding if embedding is not None and key == "lm_head.weight" else key
            if name not in shapes:
                raise ConfigurationError(f"{name!r} is not a weight of {self.model_path} (checked: {len(checked)})")
            if list(tensor.shape) != shapes[name]:
                raise ConfigurationError(
                    f"weight {name!r} has shape {list(tensor.shape)}, the model's has {shapes[name]}"
                )
            checked.append((name, tensor.detach()))
        if self.async_engine or _engine_in_subprocess():  # the engine core runs in another process
            self.llm.collective_rpc("twinkle_reload_weights", args=([(name, pack(t)) for name, t in checked],))
        else:
            self.llm.collective_rpc("twinkle_reload_weights", args=(checked,))
        self.reset_prefix_cache()
        return len(checked)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's cached prompt prefixes (their KV entries are stale once weights change)."""
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory between rounds (vLLM's ``sleep``; on a CPU vLLM keeps it)."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        """Stop an async engine's process and event loop, and delete the adapters' files, now (else when the
        sampler is collected)."""
        _shutdown(self.llm)
        self._files.close()

    # ------------------------------------------------------------------ sampling

    def sample_stream(
        self,
        inputs: InputFeature | Trajectory | list[InputFeature | Trajectory],
        sampling_params: SamplingParams | None = None,
        adapter_name: AdapterSpec = None,
        num_samples: int | None = None,
        use_base_model: bool = False,
    ) -> Iterator[SampleChunk]:
        """:meth:`sample`, but yielding each completion's new tokens as they are generated (``async_engine=True``).

        Arguments are :meth:`sample`'s, checked the same way when it is called;
        chunks of different completions interleave in the order the engine
        produces them (see :class:`SampleChunk`). Stopping early (closing the
        iterator) aborts the completions still running. A sampler built as a
        Ray actor (``remote_group=``) cannot stream: a call's result reaches
        the driver whole.
        """
        if get_runtime().mode == "ray_worker":
            raise ConfigurationError(
                "sample_stream cannot stream out of a Ray actor (a call's result reaches the driver whole): use "
                "sample(), or build vLLMSampler(..., async_engine=True) without remote_group"
            )
        if not self.async_engine:
            raise ConfigurationError(
                "sample_stream needs an engine serving requests as they come: vLLMSampler(..., async_engine=True)"
            )
        request = self._prepare(inputs, sampling_params, adapter_name, num_samples, use_base_model)
        prompts, loras = self._engine_requests(request.prompts)
        with_logprobs = requested(request.params.logprobs)
        outputs = self.llm.stream(prompts, vllm_params(request.params, request.stop), lora_request=loras)
        return (chunk for index, output in outputs for chunk in chunks(index, output, with_logprobs))

    def _check_prompts(self, prompts: list[Prompt]) -> None:
        for index, prompt in enumerate(prompts):
            if prompt.feature.get("pixel_values") is not None:
                raise InvalidInputError(
                    f"inputs[{index}] has images, which vLLMSampler does not pass to vLLM yet: use TorchSampler"
                )

    def _generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Every request's prompts as engine requests of one ``generate`` call, each with its request's parameters."""
        prompts, loras, params = [], [], []
        for request in requests:
            request_prompts, request_loras = self._engine_requests(request.prompts)
            prompts += request_prompts
            loras += request_loras
            params += [vllm_params(request.params, request.stop)] * len(request.prompts)
        outputs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        generations, start = [], 0
        for request in requests:
            generations.append(_generation(request, outputs[start : start + len(request.prompts)]))
            start += len(request.prompts)
        return generations

    def _engine_requests(self, prompts: list[Prompt]) -> tuple[list[Any], list[Any]]:
        """vLLM's prompt and ``LoRARequest`` (base rows: the zero adapter when needed) of every prompt."""
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=prompt.input_ids) for prompt in prompts]
        return requests, [self._zero if prompt.adapter is None else self._served[prompt.adapter] for prompt in prompts]


def _generation(request: GenerationRequest, outputs: list[Any]) -> Generation:
    """One request's completions and prompt log-probs from its prompts' ``RequestOutput`` s."""
    params = request.params
    k = topk_count(params.logprobs)
    generation = Generation(
        completions=[
            completion(sample, requested(params.logprobs), k) for output in outputs for sample in output.outputs
        ]
    )
    if requested(params.prompt_logprobs):
        prompt_k = topk_count(params.prompt_logprobs)
        per_prompt = [
            prompt_logprobs(prompt.input_ids, output.prompt_logprobs, prompt_k)
            for prompt, output in zip(request.prompts, outputs, strict=True)
        ]
        generation.prompt_logprobs = [logprobs for logprobs, _ in per_prompt]
        generation.topk_prompt_logprobs = [alternatives for _, alternatives in per_prompt] if prompt_k else None
    return generation


def _shutdown(engine: Any) -> None:
    if isinstance(engine, AsyncEngine):
        engine.shutdown()


def _engine_in_subprocess() -> bool:
    from vllm import envs

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)


def _checkpoint_shapes(model_path: str) -> tuple[dict[str, list[int]], bool]:
    """Every weight's shape in the model's safetensors checkpoint, and whether its output layer is tied."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                shapes[key] = list(handle.get_slice(key).get_shape())
    config = json.loads((Path(model_path) / "config.json").read_text())
    return shapes, bool(config.get("tie_word_embeddings", False))
