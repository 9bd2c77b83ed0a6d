import json
import os

import pytest
import torch
from peft import LoraConfig

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.hub import resolve_dataset
from twinkle.model import TransformersModel


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


@pytest.fixture(scope="session")
def short_features():
    """Four 10-13 token sequences, the second half supervised: forward/backward passes that cost little."""
    generator = torch.Generator().manual_seed(0)
    features = []
    for length in (10, 11, 12, 13):
        ids = torch.randint(0, 5000, (length,), generator=generator).tolist()
        labels = [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]
        features.append(make_input_feature(ids, labels))
    return features


@pytest.fixture(scope="session")
def new_lora_model():
    """``new_lora_model(*names, lora_dropout=0.0, **adapter_kwargs)``: the tiny model with LoRA adapters, B non-zero.

    LoRA starts with B = 0, i.e. exactly the base model; random B makes every
    adapter change the logits, so a check that weights were saved, loaded or
    kept apart cannot pass by accident.
    """

    def make(*names: str, lora_dropout: float = 0.0, **adapter_kwargs) -> TransformersModel:
        torch.manual_seed(0)
        model = TransformersModel(device="cpu")
        for index, name in enumerate(names or ("default",)):
            config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=lora_dropout)
            model.add_adapter_to_model(name, config, **adapter_kwargs)
            generator = torch.Generator().manual_seed(index)
            with torch.no_grad():
                for param_name, param in model.model.named_parameters():
                    if "lora_B" in param_name and f".{name}." in param_name:
                        param.normal_(0, 0.1, generator=generator)
        return model

    return make
