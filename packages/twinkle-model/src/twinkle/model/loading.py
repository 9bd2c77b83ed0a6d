"""The causal LM a model trains: loaded onto its device, with its activation checkpointing, kernels and patches.

Activation (gradient) checkpointing keeps only the decoder layers' inputs and
recomputes the rest in backward: ``gradient_checkpointing=True`` checkpoints every decoder layer; an int ``n``
every ``n``-th one (the rest keep their activations, trading memory back for
speed). It is transformers' own per-layer checkpointing, non-reentrant, so
it composes with LoRA (PEFT's or ``MultiLoraLinear``'s per-row adapters),
FSDP2 and the shared passes: the pass engine back-propagates inside the rows'
adapter routing, so a recomputed layer sees the adapters its forward saw, and
dropout masks are replayed from the saved RNG state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from twinkle.errors import ConfigurationError
from twinkle.patch import KernelsSpec, PatchSpec, accelerate

__all__ = ["CheckpointingPolicy", "auto_class", "enable_activation_checkpointing", "load_causal_lm"]

CheckpointingPolicy = bool | int  # False: off; True: every decoder layer; n: every n-th decoder layer


def enable_activation_checkpointing(model: Any, policy: CheckpointingPolicy) -> None:
    """Turn on checkpointing of ``model``'s decoder layers by ``policy`` (a no-op for ``False``)."""
    if policy is False:
        return
    if not isinstance(policy, int) or policy < 1:
        raise ConfigurationError(
            f"gradient_checkpointing must be True, False or a layer interval n >= 1 (every n-th decoder layer), "
            f"got {policy!r}"
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigurationError(f"{type(model).__name__} does not support activation checkpointing")
    every_n_layers = 1 if policy is True else policy
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every_n_layers)


def load_causal_lm(
    model_path: str,
    device: torch.device,
    gradient_checkpointing: CheckpointingPolicy,
    kernels: KernelsSpec,
    patches: Sequence[PatchSpec],
    **from_pretrained_kwargs: Any,
) -> Any:
    """A transformers ``PreTrainedModel`` in training mode (typed Any: nn.Module's typing knows few of its methods).

    A vision-language model (one transformers has no causal-LM class for, e.g. Qwen3-VL) loads as its
    image-text-to-text class, vision tower included.
    """
    model: Any = auto_class(model_path).from_pretrained(model_path, **from_pretrained_kwargs)
    model.to(device)
    model.train()
    enable_activation_checkpointing(model, gradient_checkpointing)
    accelerate(model, kernels, patches)
    return model


def auto_class(model_path: str) -> Any:
    """``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a vision-language model."""
    model_type = AutoConfig.from_pretrained(model_path).model_type
    return AutoModelForCausalLM if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
