"""``builtin://qwen3-vl-tiny``: deterministic, complete for transformers' Qwen3-VL, image processor offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle.hub import resolve_model
from twinkle.hub.models import qwen3_vl_tiny


@pytest.fixture(scope="module")
def vl_dir(session_cache: Path) -> Path:
    return Path(resolve_model("builtin://qwen3-vl-tiny"))


def test_build_is_deterministic(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        qwen3_vl_tiny.build(tmp_path / name)
    files = sorted(path.name for path in (tmp_path / "a").iterdir())
    assert "preprocessor_config.json" in files and "model.safetensors" in files
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_loads_every_weight_in_transformers_qwen3_vl(vl_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText, Qwen3VLForConditionalGeneration

    model, info = AutoModelForImageTextToText.from_pretrained(str(vl_dir), output_loading_info=True)
    assert isinstance(model, Qwen3VLForConditionalGeneration)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # tied, as in qwen3-tiny
    assert model.config.image_token_id == 151655 and model.config.vision_start_token_id == 151652
    assert sum(p.numel() for p in model.model.visual.parameters()) < 200_000


def test_image_processor_and_chat_template_load_offline(vl_dir: Path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    processor = AutoImageProcessor.from_pretrained(str(vl_dir))
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (16, 2, 2)
    out = processor(images=[Image.new("RGB", (64, 96), (255, 0, 0))], return_tensors="np")
    assert out["image_grid_thw"].tolist() == [[1, 6, 4]]  # 96 px high, 64 wide: 6 x 4 patches of 16 px
    assert out["pixel_values"].shape == (24, 3 * 2 * 16 * 16)
    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == f"<|im_start|>user\n{image}Colour?<|im_end|>\n<|im_start|>assistant\n"
