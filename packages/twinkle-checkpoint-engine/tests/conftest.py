import pytest
import torch
from peft import LoraConfig

from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler

# Trainer and sampler hold float64 weights. A merged sync computes W + s·B·A where the trainer computes
# x·W + s·(x·A)·B: in float32 that reassociation alone moved log-probs by 1.2e-5 after one step, depending on
# the step's gradients and the CPU. In float64 it is ~1e-14; what is left is the sampler's float32 logits for
# sampling and log-probs (~1e-6 at |lp| < 20 over 151k logits), so 1e-5 bounds a sync on any CPU while a
# missed or stale one moves log-probs by > 1e-3.
DTYPE = torch.float64


@pytest.fixture(scope="session")
def template():
    from twinkle.template import Template

    return Template("builtin://qwen3-tiny", max_length=256)


@pytest.fixture(scope="session")
def prompts(template):
    questions = ["What is 12 plus 30?", "Who are you?", "Name a colour.", "Count to three."]
    return [
        template.encode({"messages": [{"role": "user", "content": q}]}, add_generation_prompt=True) for q in questions
    ]


@pytest.fixture
def sampler(template):
    """A fresh sampler: merged syncs overwrite its base weights."""
    sampler = TorchSampler(device="cpu", dtype=DTYPE)
    sampler.set_template(template)
    return sampler


@pytest.fixture
def lora_model():
    """A trainer with LoRA adapter 'policy' (random, non-zero B: it changes every prediction) and an optimizer."""
    torch.manual_seed(0)
    model = TransformersModel(device="cpu", dtype=DTYPE)
    model.add_adapter_to_model("policy", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    model.set_optimizer("AdamW", lr=5e-2)
    return model
