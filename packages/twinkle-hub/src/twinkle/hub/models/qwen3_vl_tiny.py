"""``builtin://qwen3-vl-tiny``: a Qwen3-VL vision-language model small enough to train on a CPU.

It is transformers' real ``Qwen3VLForConditionalGeneration``: a ViT over 16-pixel patches (two frames per
temporal patch, learned position embeddings interpolated to the image's grid, 2x2 patch merging into one
language token, a DeepStack merger feeding the first language layer) in front of the ``builtin://qwen3-tiny``
language model shape (Qwen3 with interleaved multimodal rotary positions). The tokenizer, special token ids
and ChatML chat template are the embedded Qwen ones; the chat template also renders image parts as
``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen3-VL's does.

The image processor is transformers' ``Qwen2VLImageProcessor`` (Qwen3-VL's) with Qwen3-VL's settings
(16-pixel patches, merge size 2, mean and std 0.5) and a small pixel budget, saved as
``preprocessor_config.json`` so ``AutoImageProcessor.from_pretrained`` loads it offline. A 64x64 image
becomes a 4x4 patch grid and 4 language tokens.

Weights come from fixed-seed numpy generators (no torch needed to build, same bytes every build): the
language model from :func:`decoder_weights`, the vision tower from :func:`vision_weights` (matrices
N(0, 0.02), norm scales ones, biases zeros).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle.hub.models.chat_template import QWEN3_VL_CHAT_TEMPLATE
from twinkle.hub.models.decoder_weights import INIT_STD, DecoderLayout, decoder_weights
from twinkle.hub.models.families import TINY_SHAPE
from twinkle.hub.models.qwen3_tiny import WEIGHT_SEED, write_model

if TYPE_CHECKING:
    from transformers import Qwen3VLConfig

__all__ = ["IMAGE_PROCESSOR_SETTINGS", "build", "tiny_vl_config", "vision_weights"]

VISION_SEED = WEIGHT_SEED + 10
PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# What Qwen3-VL's preprocessor_config.json sets, with a pixel budget for tiny images: at least one merged
# 32x32 unit, at most 128x128 pixels (64 patches, 16 language tokens) per image.
IMAGE_PROCESSOR_SETTINGS: dict[str, Any] = {
    "patch_size": PATCH_SIZE,
    "merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
}
VISION_SHAPE: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,  # the language model's hidden size
    "patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "num_position_embeddings": 64,  # an 8x8 table, bilinearly interpolated to each image's grid
    "deepstack_visual_indexes": [0],
}


def tiny_vl_config() -> Qwen3VLConfig:
    """The architecture of ``builtin://qwen3-vl-tiny``."""
    from transformers import Qwen3VLConfig

    text = {
        **TINY_SHAPE,  # the other tiny families' language model, with Qwen3's head size
        "head_dim": 16,
        # Qwen3-VL's interleaved multimodal rotary sections (24, 20, 20 of 64 frequencies), scaled to 8.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
    }
    return Qwen3VLConfig(
        architectures=["Qwen3VLForConditionalGeneration"],
        text_config=text,
        vision_config=dict(VISION_SHAPE),
        tie_word_embeddings=True,
        dtype="float32",
    )


def vision_weights(config: Any, seed: int = VISION_SEED) -> dict[str, np.ndarray]:
    """Float32 weights of the vision tower (``model.visual.*``) for ``config.vision_config``."""
    vision = config.vision_config
    rng = np.random.default_rng(seed)
    hidden, width, out = vision.hidden_size, vision.intermediate_size, vision.out_hidden_size
    merged = hidden * vision.spatial_merge_size**2

    def normal(*shape: int) -> np.ndarray:
        values: np.ndarray = rng.standard_normal(shape, dtype=np.float32) * np.float32(INIT_STD)
        return values

    def norm(prefix: str, size: int) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": np.ones(size, np.float32), f"{prefix}.bias": np.zeros(size, np.float32)}

    def linear(prefix: str, out_size: int, in_size: int) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": normal(out_size, in_size), f"{prefix}.bias": np.zeros(out_size, np.float32)}

    def merger(prefix: str, norm_size: int) -> dict[str, np.ndarray]:
        return {
            **norm(f"{prefix}.norm", norm_size),
            **linear(f"{prefix}.linear_fc1", merged, merged),
            **linear(f"{prefix}.linear_fc2", out, merged),
        }

    patch = (hidden, vision.in_channels, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
    weights = {
        "model.visual.patch_embed.proj.weight": normal(*patch),
        "model.visual.patch_embed.proj.bias": np.zeros(hidden, np.float32),
        "model.visual.pos_embed.weight": normal(vision.num_position_embeddings, hidden),
    }
    for block in range(vision.depth):
        prefix = f"model.visual.blocks.{block}"
        weights.update(norm(f"{prefix}.norm1", hidden))
        weights.update(norm(f"{prefix}.norm2", hidden))
        weights.update(linear(f"{prefix}.attn.qkv", 3 * hidden, hidden))
        weights.update(linear(f"{prefix}.attn.proj", hidden, hidden))
        weights.update(linear(f"{prefix}.mlp.linear_fc1", width, hidden))
        weights.update(linear(f"{prefix}.mlp.linear_fc2", hidden, width))
    weights.update(merger("model.visual.merger", hidden))  # normalises each patch before merging
    for index in range(len(vision.deepstack_visual_indexes)):
        weights.update(merger(f"model.visual.deepstack_merger_list.{index}", merged))  # after merging
    return weights


def build(target: Path) -> None:
    """Write the model directory: config, weights, tokenizer with the VL chat template, image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = tiny_vl_config()
    language = decoder_weights(config.text_config, WEIGHT_SEED + 5, DecoderLayout(qk_norm=True))
    weights = {key.replace("model.", "model.language_model.", 1): value for key, value in language.items()}
    weights.update(vision_weights(config))
    write_model(target, config, weights, chat_template=QWEN3_VL_CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR_SETTINGS).save_pretrained(str(target))
    # What AutoProcessor reads to pair the image processor with the tokenizer (where torchvision is installed:
    # transformers' Qwen3-VL processor also wants its video processor, which needs torchvision).
    processor = {"processor_class": "Qwen3VLProcessor"}
    (target / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n", encoding="utf-8")
