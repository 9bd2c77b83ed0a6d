"""A MegatronModel's weights synced into a TorchSampler by CheckpointEngineManager: the trainer's logits.

The adapter goes as whole PEFT tensors (gathered from any tensor-parallel shards) or merged into the base
weights under transformers' names; either way the sampler computes the trainer's logits (1e-5; in float64, as
transformers' float32 RMSNorm is the only difference left on any CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.hub import resolve_model
from twinkle.module import adapter_rows
from twinkle.sampler import TorchSampler

megatron = pytest.importorskip("twinkle.model.megatron", reason="needs twinkle-model[megatron]")
sys.path.insert(0, str(Path(__file__).parent))
from conversations import encoded_conversations  # noqa: E402

MODEL = "builtin://qwen3-tiny"
TOL = {"atol": 1e-5, "rtol": 1e-5}
pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("merge", [False, True])
def test_weights_sync_into_a_sampler(merge):
    features = encoded_conversations(MODEL)
    model = megatron.MegatronModel(MODEL, device="cpu", dtype=torch.float64)
    model.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}, seed=0)
    model.set_optimizer("AdamW", lr=1e-2)
    for _ in range(2):  # B leaves zero: the adapter changes the logits
        model.forward_backward(features)
        model.clip_grad_and_step()
    sampler = TorchSampler(MODEL, device="cpu", dtype=torch.float64)
    CheckpointEngineManager(model, sampler).sync_weights(merge_and_sync=merge)
    ids = torch.tensor([features[0]["input_ids"]])
    with torch.no_grad(), adapter_rows(sampler.model, [None if merge else "default"]):
        sampled = sampler.model(ids).logits[0]
    trained = model.forward_only(features[:1], return_logits=True).logits[0]
    assert torch.allclose(sampled, trained, **TOL), float((sampled - trained).abs().max())
    plain = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float64)
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits[0], trained, atol=1e-3)  # the steps changed the model
