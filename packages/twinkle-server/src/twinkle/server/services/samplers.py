"""The server's sampler back-end (``sampler:`` in the config): which class every pool builds, with what.

``torch`` (the default) is :class:`~twinkle.sampler.TorchSampler` in the
server's process; ``vllm`` is :class:`~twinkle.sampler.vLLMSampler` (extra
``twinkle-sampler[vllm]``), serving every tenant's adapters as vLLM LoRA
requests. Both are used through the one :class:`~twinkle.sampler.Sampler`
interface, so the service layer does not know which it has. ``sampler_args``
are the back-end's own keyword arguments; the server sets the model, the
device and (vLLM) the LoRA slots itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from twinkle.errors import ConfigurationError

if TYPE_CHECKING:
    from twinkle.sampler import TorchSampler, vLLMSampler

    # A back-end the pool syncs weights into (``CheckpointEngineManager``): the Sampler interface and weight loads.
    SamplerBackend = TorchSampler | vLLMSampler

VLLM_EXTRA = "twinkle-sampler[vllm]"
# The sampler_args each back-end takes (the others it has are the server's to set).
SAMPLER_ARGS: dict[str, tuple[str, ...]] = {
    "torch": ("attn_implementation",),
    "vllm": ("engine_args", "async_engine", "exact_logprobs", "zero_adapter_for_base"),
}
# vLLM's max_lora_rank must be one of these; the server rounds its max_rank up to the next.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def sampler_problems(kind: Any, args: Any, record_routing: bool) -> list[str]:
    """What is wrong with ``sampler: kind`` and ``sampler_args: args`` (each problem naming its key)."""
    if kind not in SAMPLER_ARGS:
        return [f"sampler: {kind!r} is not a sampler back-end; one of {', '.join(SAMPLER_ARGS)}"]
    problems = []
    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(
            f"sampler: 'vllm' needs vLLM, which is not installed: pip install '{VLLM_EXTRA}' (or use sampler: torch)"
        )
    if kind == "vllm" and record_routing:
        problems.append("record_routing: vLLMSampler does not record MoE routing; use sampler: torch")
    for key in args or {}:
        if key not in SAMPLER_ARGS[kind]:
            known = ", ".join(SAMPLER_ARGS[kind])
            problems.append(f"sampler_args.{key}: not an option of the {kind} sampler here (options: {known})")
    engine_args = (args or {}).get("engine_args")
    if engine_args is not None and not isinstance(engine_args, dict):
        problems.append(f"sampler_args.engine_args: expected a mapping, got {type(engine_args).__name__}")
    elif kind == "vllm" and "model" in (engine_args or {}):
        problems.append("sampler_args.engine_args.model: the server samples its model_id; leave it out")
    return problems


def build_sampler(
    kind: str,
    model_path: str,
    device: str | None,
    options: Mapping[str, Any],
    args: Mapping[str, Any],
    max_loras: int,
    max_rank: int,
) -> SamplerBackend:
    """A ready sampler of ``kind`` for ``model_path``; ``options`` are ``ServerConfig.model_options``' share.

    vLLM serves LoRA with ``max_loras`` slots and the smallest ``max_lora_rank``
    vLLM has that holds ``max_rank``, unless ``engine_args`` set them; it picks its
    own device (``device`` and the torch-only ``kernels`` do not apply).
    """
    problems = sampler_problems(kind, args, bool(options.get("record_routing")))
    if problems:
        raise ConfigurationError("; ".join(problems))
    if kind == "torch":
        from twinkle.sampler import TorchSampler

        return TorchSampler(model_id=model_path, device=device, **options, **args)
    from twinkle.sampler import vLLMSampler

    rank = next((size for size in VLLM_LORA_RANKS if size >= max_rank), VLLM_LORA_RANKS[-1])
    engine_args = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": rank, **args.get("engine_args", {})}
    return vLLMSampler(model_path, engine_args=engine_args, **{k: v for k, v in args.items() if k != "engine_args"})
