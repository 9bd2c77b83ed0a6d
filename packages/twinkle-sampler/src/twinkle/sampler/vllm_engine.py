"""What :class:`~twinkle.sampler.vLLMSampler` needs to know about, and do to, a vLLM engine.

- **Model facts** read before the engine starts, from the model directory alone
  (config on the ``meta`` device, no weights): the linear layers LoRA may
  target, one layer for probe and zero adapters, and whether vLLM's CPU
  attention kernels support the head size.
- **Worker methods**, mixed into the engine's workers by vLLM's
  ``worker_extension_cls`` engine argument (:class:`WorkerExtension`) and
  called by name through the public ``collective_rpc``, so they run the same
  in-process and in engine subprocesses (where a function could only be
  pickled with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``):

  - :func:`use_exact_logprobs`: vLLM computes log-probs with a float32
    ``log_softmax``, whose one-pass sum over a 151k vocabulary is off by up to
    ~7e-5 nats on a CPU (measured on the embedded Qwen3 vocabulary);
    ``logits - logsumexp(logits)`` (the trainer's formula) is within ~3e-6 of
    float64, so sampler and trainer log-probs agree to 1e-5.
  - :func:`retie_output_layer`: after ``reload_weights`` a tied output layer is
    tied again to the new embedding and re-packed (vLLM's CPU GEMM keeps a
    packed copy of the weight, which a reload of the embedding alone leaves stale).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

from twinkle.errors import ConfigurationError


def linear_layers(model_path: str) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of every linear layer but the output layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    output = model.get_output_embeddings()
    return {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not output
    }


def lora_target_suffixes(layers: dict[str, tuple[int, int]]) -> list[str]:
    """The layer-name suffixes vLLM may put LoRA on: every linear layer but the output layer.

    Leaving the output layer out of ``lora_target_modules`` keeps vLLM from
    wrapping it in its LoRA logits processor, whose CPU kernel fails on any
    request with ``prompt_logprobs`` (vLLM 0.32: "einsum(): subscript b has size
    ..."); PEFT's ``all-linear`` never targets it anyway.
    """
    return sorted({name.rsplit(".", 1)[-1] for name in layers})


def check_cpu_head_size(model_path: str) -> None:
    """Refuse, naming the head size, a model whose attention heads vLLM's CPU kernels cannot run."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = json.loads((Path(model_path) / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ConfigurationError(
            f"{model_path} has attention heads of size {head_size}; vLLM's CPU attention supports {supported}. "
            "Sample this model with TorchSampler, or use a model whose head_dim is one of those"
        )


def exact_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)`` as the trainer computes it: the logit minus a float32 log-sum-exp."""
    logits = logits.float()
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def use_exact_logprobs(worker: Any) -> None:
    """Make the worker's sampler compute sampled-token and prompt log-probs with :func:`exact_logprobs`."""
    worker.model_runner.sampler.compute_logprobs = exact_logprobs


def retie_output_layer(worker: Any) -> bool:
    """Tie a tied output layer to the (reloaded) input embedding again and re-pack it; False if untied."""
    model = worker.model_runner.get_model()
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embedding is None or not getattr(config, "tie_word_embeddings", False):
        return False
    head.quant_method.tie_weights(head, embedding)
    head.quant_method.process_weights_after_loading(head)
    return True


class WorkerExtension:
    """What vLLMSampler calls in vLLM's workers (``worker_extension_cls``; ``self`` is the worker)."""

    def twinkle_use_exact_logprobs(self) -> None:
        use_exact_logprobs(self)

    def twinkle_retie_output_layer(self) -> bool:
        return retie_output_layer(self)

    def twinkle_reload_weights(self, weights: list[tuple[str, Any]]) -> None:
        """vLLM's ``reload_weights`` of named tensors (or :func:`pack`-ed ones), then the tied output layer."""
        self.reload_weights(weights_iterator=[(name, unpack(value)) for name, value in weights])  # type: ignore[attr-defined]
        retie_output_layer(self)


def pack(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """A tensor as plain bytes, for engine subprocesses (vLLM's worker queue cannot pickle received tensors)."""
    contiguous = tensor.detach().cpu().contiguous()
    return (
        str(contiguous.dtype).removeprefix("torch."),
        list(contiguous.shape),
        contiguous.view(torch.uint8).numpy().tobytes(),
    )


def unpack(value: Any) -> torch.Tensor:
    """The tensor :func:`pack` made (a tensor passes through)."""
    if isinstance(value, torch.Tensor):
        return value
    dtype, shape, data = value
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


WORKER_EXTENSION = f"{WorkerExtension.__module__}.{WorkerExtension.__qualname__}"


def check_worker_extension(qualname: str) -> None:
    """A user's own ``worker_extension_cls`` must extend :class:`WorkerExtension` (vLLM takes one class)."""
    module, _, name = qualname.rpartition(".")
    extension = getattr(importlib.import_module(module), name, None)
    if not (isinstance(extension, type) and issubclass(extension, WorkerExtension)):
        raise ConfigurationError(
            f"engine_args worker_extension_cls={qualname!r} must subclass {WORKER_EXTENSION}, whose methods "
            "vLLMSampler calls in the engine's workers"
        )
