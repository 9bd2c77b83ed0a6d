import json
import os
from functools import partial
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict

from twinkle.data_format import IGNORE_INDEX
from twinkle.hub import resolve_dataset, resolve_model
from twinkle.sampler import TorchSampler


@pytest.fixture(scope="session")
def template():
    from twinkle.template import Template

    return Template("builtin://qwen3-tiny", max_length=256)


@pytest.fixture(scope="session")
def trajectories():
    """Six GSM8K-style questions as trajectories, the reference answer in ``user_data``."""
    path = os.path.join(resolve_dataset("builtin://gsm8k-mini"), "test.jsonl")
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle][:6]
    return [
        {"messages": [{"role": "user", "content": row["question"]}], "user_data": {"answer": row["answer"]}}
        for row in rows
    ]


@pytest.fixture(scope="session")
def prompts(template, trajectories):
    """The trajectories encoded for generation, as ``dataset.encode(add_generation_prompt=True)`` gives them."""
    return [template.encode(trajectory, add_generation_prompt=True) for trajectory in trajectories]


@pytest.fixture(scope="session")
def shared_sampler(template):
    sampler = TorchSampler(device="cpu")
    sampler.set_template(template)
    return sampler


@pytest.fixture
def sampler(shared_sampler):
    """The session's TorchSampler, handed back without the adapters a test added."""
    yield shared_sampler
    for name in shared_sampler.adapter_names:
        shared_sampler.remove_adapter(name)


@pytest.fixture(scope="session")
def trained_model():
    """``trained_model(*names)``: a TransformersModel whose LoRA adapters have random (non-zero) B.

    LoRA starts as the identity (B = 0); random B makes each adapter change the
    model's predictions, so nothing passes by accident.
    """
    return partial(_trainer_with_adapters, None)


@pytest.fixture(scope="session")
def lora_of():
    """``lora_of(model, name)``: what a trainer hands a sampler, the adapter's LoraConfig and PEFT-format tensors."""

    def export(model, name):
        return model.model.peft_config[name], get_peft_model_state_dict(model.model, adapter_name=name)

    return export


# ---------------------------------------------------------------- vLLM (marker `vllm`; `make test-vllm` runs them)


@pytest.fixture(scope="session")
def vllm_model_dir():
    """The tiny Qwen3 with attention heads 32 wide (vLLM's CPU kernels run no narrower)."""
    return resolve_model("builtin://qwen3-tiny-head32")


@pytest.fixture(scope="session")
def vllm_template(vllm_model_dir):
    from twinkle.template import Template

    return Template(vllm_model_dir, max_length=256)


@pytest.fixture(scope="session")
def vllm_prompts(vllm_template, trajectories):
    return [vllm_template.encode(trajectory, add_generation_prompt=True) for trajectory in trajectories]


@pytest.fixture(scope="session")
def vllm_engine_args():
    """fp32, a small KV cache, two LoRA slots (so a batch of both test adapters fills every slot)."""
    return {
        "dtype": "float32",
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 128 << 20,
        "enforce_eager": True,
        "enable_lora": True,
        "max_lora_rank": 8,
        "max_loras": 2,
    }


@pytest.fixture(scope="session")
def vllm_trainer(vllm_model_dir):
    """``vllm_trainer(*names)``: a TransformersModel of the vLLM test model with random-B adapters of ranks 4, 8, ..."""
    return partial(_trainer_with_adapters, vllm_model_dir)


def _trainer_with_adapters(model_id: str | None, *names: str, rank: int = 4) -> Any:
    """A TransformersModel with adapters ``names`` of ranks ``rank``, 2·``rank``, ... and random (non-zero) B."""
    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(model_id=model_id, device="cpu")
    for index, name in enumerate(names):
        config = LoraConfig(r=rank * (index + 1), lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        model.add_adapter_to_model(name, config)
        generator = torch.Generator().manual_seed(index + 1)
        with torch.no_grad():
            for param_name, param in model.model.named_parameters():
                if "lora_B" in param_name and f".{name}." in param_name:
                    param.normal_(0, 0.3, generator=generator)
    return model


def _completion_logps(model: Any, sequences: Any, adapter_name: str | None = None) -> list[list[float]]:
    features = [sequence.new_input_feature for sequence in sequences]
    output = model.forward_only(inputs=features, adapter_name=adapter_name)
    return [
        logps[torch.tensor(feature["labels"]) != IGNORE_INDEX].tolist()
        for logps, feature in zip(output.logps, features, strict=True)
    ]


@pytest.fixture(scope="session")
def completion_logps() -> Any:
    """``completion_logps(model, sequences, adapter_name=None)``: the trainer's ``forward_only`` log-probs of
    each sampled sequence's completion tokens, to compare with the sampler's."""
    return _completion_logps


@pytest.fixture(scope="session")
def logprob_gap() -> Any:
    """``logprob_gap(sequences, expected)``: the largest difference between sampled and expected log-probs."""

    def gap(sequences: Any, expected: list[list[float]]) -> float:
        pairs = zip(sequences, expected, strict=True)
        return max(abs(a - b) for s, row in pairs for a, b in zip(s.logprobs, row, strict=True))

    return gap
