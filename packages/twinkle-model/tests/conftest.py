import json
import os
import tempfile

import pytest

os.environ.setdefault("TWINKLE_CACHE_DIR", tempfile.mkdtemp(prefix="twinkle-test-cache-"))

from peft import LoraConfig  # noqa: E402

from twinkle.hub import resolve_dataset  # noqa: E402


@pytest.fixture(scope="session")
def template():
    from twinkle.template import Template

    return Template("builtin://qwen3-tiny", max_length=128)


@pytest.fixture(scope="session")
def sft_features(template):
    """Sixteen encoded self-cognition conversations of varied lengths."""
    path = os.path.join(resolve_dataset("builtin://self-cognition"), "train.jsonl")
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle][:16]
    features = []
    for row in rows:
        fill = {"{{NAME}}": "Twinkle", "{{AUTHOR}}": "ModelScope"}
        query, response = row["query"], row["response"]
        for key, value in fill.items():
            query, response = query.replace(key, value), response.replace(key, value)
        messages = [{"role": "user", "content": query}, {"role": "assistant", "content": response}]
        features.append(template.encode({"messages": messages}))
    return features


@pytest.fixture
def lora_config():
    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
