"""``TorchSampler``: batched sampling in plain PyTorch over a transformers model, many LoRA adapters at once.

It runs wherever the trainer runs (CPU included) and computes log-probs the
way :class:`twinkle.model.TransformersModel` does, so a policy's sampling and
training log-probs agree to float rounding. Adapters are
:class:`twinkle.module.MultiLoraLinear` layers injected into the one copy of
the base model: rows of one batch may each use a different adapter, or none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.infra import DeviceMesh, remote_class
from twinkle.kernel import rekernelize
from twinkle.module import (
    MultiLoraLinear,
    adapter_names,
    inject_multi_lora,
    read_adapter_dir,
    remove_adapter,
    set_adapter_weights,
    split_lora_state_dict,
    topk_routers,
)
from twinkle.patch import KernelsSpec, PatchSpec, accelerate
from twinkle.registry import register
from twinkle.sampler.base import Sampler
from twinkle.sampler.decoding import Decoder
from twinkle.sampler.results import Generation, GenerationRequest


@register("sampler")
@remote_class
class TorchSampler(Sampler):
    """Samples from a Hugging Face causal LM; see the module docstring.

    ``model_id`` is anything :func:`twinkle.hub.resolve_model` accepts (default:
    the embedded ``builtin://qwen3-tiny``). ``dtype`` is the weights' dtype;
    sampling and log-probs always run in float32 on the output layer's logits.
    ``kernels`` (``True``: the family's defaults, or a mapping) and ``patches``
    go into the model through :func:`twinkle.patch.accelerate`. ``record_routing``
    (MoE models) adds every token's chosen experts to each completion's
    ``new_input_feature`` (``routed_experts``), which the trainer then replays
    (:mod:`twinkle.module.routing`).
    """

    def __init__(
        self,
        model_id: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        device_mesh: DeviceMesh | None = None,
        kernels: KernelsSpec = False,
        patches: Sequence[PatchSpec] = (),
        record_routing: bool = False,
        **from_pretrained_kwargs: Any,
    ) -> None:
        super().__init__(resolve_model(model_id))
        self.device_mesh = device_mesh
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # A transformers PreTrainedModel; typed Any because nn.Module's typing knows none of its methods.
        self.model: Any = (
            _auto_class(self.model_path)
            .from_pretrained(
                self.model_path, dtype=dtype, attn_implementation=attn_implementation, **from_pretrained_kwargs
            )
            .to(self.device)
        )
        self.model.eval().requires_grad_(False)
        accelerate(self.model, kernels, patches)
        if record_routing and not topk_routers(self.model):
            raise ConfigurationError(
                f"record_routing: {type(self.model).__name__} has no softmax top-k MoE router to record"
            )
        self.record_routing = record_routing
        pad = getattr(self.model.config.get_text_config(), "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else self.tokenizer.pad_token_id or 0

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @property
    def max_model_len(self) -> int:
        return self.model.config.get_text_config().max_position_embeddings

    @property
    def adapter_names(self) -> list[str]:
        return adapter_names(self.model)

    def add_adapter(self, name: str, config: Any, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Serve a LoRA adapter; a previous adapter of that name is replaced.

        The sampler keeps its own copy of the (small) LoRA tensors, so a trainer
        that goes on updating its adapter in place does not change what this
        sampler samples until the next :meth:`add_adapter`.
        """
        # Linear layers by module name; adapted parameters (MoE experts, routers) by the parameter's full name.
        tensors, scaling = split_lora_state_dict(name, config, state_dict, self.model)
        modules = dict(self.model.named_modules())
        parameters = {parameter for parameter, _ in self.model.named_parameters()}
        unknown = [
            target
            for target in tensors
            if target not in parameters and not isinstance(modules.get(target), (torch.nn.Linear, MultiLoraLinear))
        ]
        if unknown:
            raise ConfigurationError(
                f"adapter {name!r} targets {unknown[:3]}, which are not linear layers of {self.model_path}"
            )
        inject_multi_lora(self.model, list(tensors))
        weight = self.model.get_input_embeddings().weight
        like = {"device": weight.device, "dtype": weight.dtype, "copy": True}
        snapshot = {target: (A.detach().to(**like), B.detach().to(**like)) for target, (A, B) in tensors.items()}
        set_adapter_weights(self.model, name, snapshot, scaling)
        rekernelize(self.model)  # layers injected for this adapter get kernels too

    def load_adapter(self, name: str, path: str | Path) -> None:
        config, state_dict = read_adapter_dir(path)
        self.add_adapter(name, config, state_dict)

    def remove_adapter(self, name: str) -> None:
        remove_adapter(self.model, name)

    def reset_prefix_cache(self) -> None:
        """Nothing to clear: a TorchSampler keeps no prompt cache between :meth:`sample` calls.

        (Within one call, identical prompts share one prefill.) It exists so
        loops written for :class:`~twinkle.sampler.vLLMSampler` run unchanged.
        """

    def load_base_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors, named as in the model's own ``state_dict()``, into the base weights; returns how many.

        Tensors are copied one at a time as they arrive, so a producer can
        stream them (e.g. merged LoRA weights computed layer by layer) without
        ever holding a second copy of the model. Tensors not named keep their
        values; adapters are untouched.
        """
        targets = self.model.state_dict(keep_vars=True)
        items = weights.items() if isinstance(weights, Mapping) else weights
        count = 0
        with torch.no_grad():
            for name, tensor in items:
                target = targets.get(name)
                if target is None:
                    raise ConfigurationError(f"{name!r} is not a weight of {self.model_path} (copied so far: {count})")
                if target.shape != tensor.shape:
                    raise ConfigurationError(
                        f"weight {name!r} has shape {list(tensor.shape)}, the model's has {list(target.shape)}"
                    )
                target.copy_(tensor)
                count += 1
        return count

    def _generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        seeds = [request.params.seed for request in requests]
        generators = [None if seed is None else torch.Generator(self.device).manual_seed(seed) for seed in seeds]
        decoder = Decoder(self.model, self.pad_token_id, self.record_routing)
        with torch.inference_mode():
            return decoder.generate(requests, generators)


def _auto_class(model_path: str) -> Any:
    """``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a vision-language model (e.g. Qwen3-VL)."""
    model_type = AutoConfig.from_pretrained(model_path).model_type
    return AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
