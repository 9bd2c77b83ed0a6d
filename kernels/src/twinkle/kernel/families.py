"""Which modules of each model family a kernel replaces, by default: ``{class name: op}`` per ``model_type``.

``MultiLoraLinear`` (Twinkle's multi-adapter layer) is in every family's
mapping; the output layer's log-probs (``linear_logps``) are the pass engine's,
named by :data:`OUTPUT_LOGPS`.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAPPINGS", "OUTPUT_LOGPS", "default_mapping"]

# The mapping key of the output layer's log-probabilities: not a module, but the function the pass engine
# computes them with (``twinkle.module.chunked_token_logps`` unless a kernel replaces it).
OUTPUT_LOGPS = "output_logps"


def _dense(prefix: str) -> dict[str, str]:
    return {
        f"{prefix}RMSNorm": "rms_norm",  # the decoder's norms and Qwen3's per-head QK norms
        f"{prefix}MLP": "swiglu",
        f"{prefix}Attention": "rotary",
        "MultiLoraLinear": "multi_lora",
        OUTPUT_LOGPS: "linear_logps",
    }


DEFAULT_MAPPINGS: dict[str, dict[str, str]] = {
    "llama": _dense("Llama"),
    "mistral": _dense("Mistral"),
    "qwen2": _dense("Qwen2"),
    "qwen3": _dense("Qwen3"),
}


def default_mapping(model_type: str) -> dict[str, str]:
    """The family's default mapping (a copy, to extend); ``{}`` for a family without one."""
    return dict(DEFAULT_MAPPINGS.get(model_type, {}))
