"""The server's training back-end (``backend:`` in the config): which model classes every pool builds.

``transformers`` (the default) trains on transformers: every tenant's LoRA adapter on the shared base in a
:class:`~twinkle.model.MultiLoraModel`, and each private run (all weights, or its own base) in a
:class:`~twinkle.model.TransformersModel`. ``megatron`` (extra ``twinkle-model[megatron]``) trains on
megatron-core: :class:`~twinkle.model.megatron.MultiLoraMegatronModel` and
:class:`~twinkle.model.megatron.MegatronModel`, in the server's process on one device. Both trainers take
the same calls and save the same PEFT and transformers formats, so the service layer, the checkpoints and the
sampler back-end (which loads the transformers checkpoint) do not know which one trains.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from twinkle.model import MultiLoraModel, SharedPasses, TrainingModel, TransformersModel
from twinkle.registry import get_registry

BACKENDS = ("transformers", "megatron")
MEGATRON_EXTRA = "twinkle-model[megatron]"
# Model options that only the transformers back-end has so far.
TRANSFORMERS_ONLY = ("kernels", "record_routing")


def backend_problems(backend: Any, options: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``backend:`` next to the other ``options`` (each problem naming its key)."""
    if backend not in BACKENDS:
        return [f"backend: {backend!r} is not a training back-end; one of {', '.join(BACKENDS)}"]
    if backend == "transformers":
        return []
    problems = []
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        problems.append(
            f"backend: 'megatron' needs megatron-core, which is not installed: pip install '{MEGATRON_EXTRA}' "
            "(or use backend: transformers)"
        )
    for key in TRANSFORMERS_ONLY:
        if options.get(key):
            problems.append(f"{key}: not available with backend: megatron yet (use backend: transformers)")
    return problems


def model_classes(backend: str) -> tuple[type[SharedPasses], type[TrainingModel]]:
    """The shared base's multi-LoRA class and a private run's class of ``backend``."""
    if backend == "megatron":  # registered by twinkle-model's entry points; imports megatron-core only now
        models = get_registry("model")
        return models.get("MultiLoraMegatronModel"), models.get("MegatronModel")
    return MultiLoraModel, TransformersModel
