import os
import tempfile

import pytest

from twinkle.data_format import IGNORE_INDEX, InputFeature, make_input_feature

if "TWINKLE_CACHE_DIR" not in os.environ:  # build the builtin model once per test session
    os.environ["TWINKLE_CACHE_DIR"] = tempfile.mkdtemp(prefix="twinkle-processor-tests-")


@pytest.fixture
def features() -> list[InputFeature]:
    """Three prompt/response-like features of lengths 5, 3, 4; the last one also labels its first token."""
    return [
        make_input_feature([11, 12, 13, 14, 15], labels=[IGNORE_INDEX, IGNORE_INDEX, 13, 14, 15]),
        make_input_feature([21, 22, 23], labels=[IGNORE_INDEX, 22, 23]),
        make_input_feature([31, 32, 33, 34], labels=[31, 32, 33, 34]),
    ]


def _trained_pairs(batch: dict) -> list[tuple[int, int, int]]:
    """``(row, t, t + 1)`` for every pair the shifted loss trains: ``logits[:, t]`` predicting ``labels[:, t + 1]``."""
    row_idx, next_idx = (batch["labels"][:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    return [(row, t, t + 1) for row, t in zip(row_idx.tolist(), next_idx.tolist(), strict=True)]


@pytest.fixture
def shifted_pairs():
    return _trained_pairs


@pytest.fixture(scope="session")
def qwen3_tiny_dir() -> str:
    from twinkle.hub import resolve_model

    return resolve_model("builtin://qwen3-tiny")


@pytest.fixture(scope="session", params=["sdpa", "eager"])
def qwen3_tiny(request, qwen3_tiny_dir):
    """The builtin Qwen3 model in float32, once per attention implementation; ``use_cache`` left at its default."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny_dir, dtype=torch.float32, attn_implementation=request.param)
    return model.eval()


@pytest.fixture(scope="session")
def text_features(qwen3_tiny_dir) -> list[InputFeature]:
    """Real tokenised sentences of different lengths, response-style labels on all but the first token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_tiny_dir)
    texts = [
        "Twinkle packs several sequences into one row.",
        "Hi!",
        "Position ids restart at zero where a new sequence begins, so attention stays inside it.",
    ]
    return [make_input_feature(ids, labels=[IGNORE_INDEX, *ids[1:]]) for ids in tokenizer(texts)["input_ids"]]
