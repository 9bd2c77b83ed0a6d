"""The table of ``builtin://`` models and datasets that Twinkle can generate offline.

Built-ins let every cookbook, test and demo run on a CPU with no network. Each
entry names its builder as ``"module:function"`` so that importing this table
(and ``twinkle.hub``) stays cheap: transformers is imported only when the model
is actually built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from twinkle.errors import ResourceNotFoundError

BUILTIN_SCHEME = "builtin://"
DEFAULT_MODEL = "builtin://qwen3-tiny"

Kind = Literal["model", "dataset"]


@dataclass(frozen=True)
class BuiltinSpec:
    """One built-in: what it is, how to build it, and which format version it has."""

    id: str
    kind: Kind
    description: str
    version: int
    builder: str

    @property
    def cache_name(self) -> str:
        """Directory name under ``<cache>/builtin``; a new version gets a new directory."""
        return f"{self.id.removeprefix(BUILTIN_SCHEME)}-v{self.version}"

    def build(self, target: Path) -> None:
        """Write the built-in's files into the empty directory ``target``."""
        module_name, function_name = self.builder.split(":")
        getattr(importlib.import_module(module_name), function_name)(target)


_SPECS = (
    BuiltinSpec(
        id=DEFAULT_MODEL,
        kind="model",
        description="Qwen3-architecture causal LM (4 layers, hidden 64) with the real Qwen3 tokenizer; "
        "random weights, runs on a CPU",
        version=2,
        builder="twinkle.hub.models.qwen3_tiny:build",
    ),
    BuiltinSpec(
        id="builtin://qwen3-tiny-head32",
        kind="model",
        description="builtin://qwen3-tiny with attention heads 32 wide instead of 16 (vLLM's CPU attention takes "
        "no narrower); same tokenizer and weight generator",
        version=1,
        builder="twinkle.hub.models.qwen3_tiny:build_head32",
    ),
    BuiltinSpec(
        id="builtin://llama-tiny",
        kind="model",
        description="Llama-architecture causal LM (4 layers, hidden 64) with the Qwen3 tokenizer; random weights",
        version=1,
        builder="twinkle.hub.models.families:build_llama_tiny",
    ),
    BuiltinSpec(
        id="builtin://qwen2-tiny",
        kind="model",
        description="Qwen2-architecture causal LM (q/k/v biases; 4 layers, hidden 64) with the Qwen3 tokenizer; "
        "random weights",
        version=1,
        builder="twinkle.hub.models.families:build_qwen2_tiny",
    ),
    BuiltinSpec(
        id="builtin://qwen3-moe-tiny",
        kind="model",
        description="Qwen3-MoE causal LM (8 experts, top-2, in every one of 4 layers; hidden 64) with the Qwen3 "
        "tokenizer; random weights",
        version=1,
        builder="twinkle.hub.models.families:build_qwen3_moe_tiny",
    ),
    BuiltinSpec(
        id="builtin://glm4-tiny",
        kind="model",
        description="GLM-4-architecture causal LM (q/k/v biases, half-head rotary, sandwich norms; 4 layers, "
        "hidden 64) with the Qwen3 tokenizer; random weights",
        version=1,
        builder="twinkle.hub.models.families:build_glm4_tiny",
    ),
    BuiltinSpec(
        id="builtin://qwen3-vl-tiny",
        kind="model",
        description="Qwen3-VL vision-language model (2-block ViT over 16-pixel patches, 4-layer hidden-64 Qwen3 "
        "language model) with the Qwen3 tokenizer and an image processor; random weights",
        version=1,
        builder="twinkle.hub.models.qwen3_vl_tiny:build",
    ),
    BuiltinSpec(
        id="builtin://self-cognition",
        kind="dataset",
        description="English and Chinese self-introduction Q&A with {{NAME}}/{{AUTHOR}} placeholders (train)",
        version=1,
        builder="twinkle.hub.data.self_cognition:build",
    ),
    BuiltinSpec(
        id="builtin://gsm8k-mini",
        kind="dataset",
        description="GSM8K-format one- and two-step arithmetic word problems with '#### <answer>' (train/test)",
        version=1,
        builder="twinkle.hub.data.gsm8k_mini:build",
    ),
    BuiltinSpec(
        id="builtin://preference-mini",
        kind="dataset",
        description="DPO pairs: polite correct arithmetic answers preferred over wrong or rude ones (train/test)",
        version=1,
        builder="twinkle.hub.data.preference_mini:build",
    ),
    BuiltinSpec(
        id="builtin://clevr-mini",
        kind="dataset",
        description="64x64 CLEVR-style scenes drawn with Pillow, with counting, colour and shape questions and "
        "short verifiable answers (train/test)",
        version=1,
        builder="twinkle.hub.data.clevr_mini:build",
    ),
)
_BUILTINS = {spec.id: spec for spec in _SPECS}


def list_builtin(kind: Kind | None = None) -> dict[str, str]:
    """Map each ``builtin://`` id (optionally only models or only datasets) to a one-line description."""
    return {spec.id: spec.description for spec in _SPECS if kind is None or spec.kind == kind}


def is_builtin(ref: str) -> bool:
    """Whether ``ref`` names a known built-in model or dataset."""
    return ref in _BUILTINS


def get_builtin(ref: str, kind: Kind) -> BuiltinSpec:
    """Return the spec of ``ref``, or raise naming the built-ins of ``kind`` that do exist."""
    spec = _BUILTINS.get(ref)
    if spec is not None and spec.kind == kind:
        return spec
    available = ", ".join(list_builtin(kind))
    if spec is not None:
        raise ResourceNotFoundError(f"{ref!r} is a builtin {spec.kind}, not a {kind}. Builtin {kind}s: {available}")
    raise ResourceNotFoundError(f"Unknown builtin {kind} {ref!r}. Builtin {kind}s: {available}")
