"""After a sync the sampler's log-probs are the trainer's, and a LoRA sync moves only the adapter."""

import pytest
import torch

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.interfaces import CheckpointEngine
from twinkle.model import TransformersModel
from twinkle.registry import build

PARAMS = SamplingParams(max_tokens=8, temperature=1.0, seed=0)


def _max_logprob_gap(model, response, adapter_name="policy"):
    features = [s.new_input_feature for s in response.sequences]
    trainer = model.forward_only(inputs=features, adapter_name=adapter_name).logps
    gaps = []
    for sequence, logps, feature in zip(response.sequences, trainer, features, strict=True):
        expected = logps[torch.tensor(feature["labels"]) != IGNORE_INDEX]
        gaps.append((torch.tensor(sequence.logprobs) - expected).abs().max().item())
    return max(gaps)


def _train_one_step(model, response):
    model.forward_backward(inputs=[s.new_input_feature for s in response.sequences])
    model.clip_grad_and_step()


def test_lora_sync_gives_the_trainers_logprobs_after_every_step(lora_model, sampler, prompts):
    manager = build("checkpoint_engine", "CheckpointEngineManager", model=lora_model, sampler=sampler)
    assert isinstance(manager, CheckpointEngine)
    manager.sync_weights()
    first = sampler.sample(prompts, PARAMS, adapter_name="policy")
    assert _max_logprob_gap(lora_model, first) <= 1e-5

    _train_one_step(lora_model, first)
    stale = sampler.sample(prompts, PARAMS, adapter_name="policy")
    assert stale.sequences[0].logprobs == first.sequences[0].logprobs, "nothing changes until the next sync"
    assert _max_logprob_gap(lora_model, stale) > 1e-3, "the step moved the policy"
    manager.sync_weights(merge_and_sync=False)
    assert _max_logprob_gap(lora_model, sampler.sample(prompts, PARAMS, adapter_name="policy")) <= 1e-5
    assert sampler.adapter_names == ["policy"]


def test_after_a_lora_sync_a_sample_without_a_name_is_on_policy(lora_model, sampler, prompts):
    CheckpointEngineManager(lora_model, sampler).sync_weights(merge_and_sync=False)
    assert _max_logprob_gap(lora_model, sampler.sample(prompts, PARAMS)) <= 1e-5, "the synced adapter samples"
    base = sampler.sample(prompts, PARAMS, use_base_model=True)
    assert _max_logprob_gap(lora_model, base) > 1e-3, "the bare base model only when asked for"


def test_merged_sync_makes_the_base_model_the_policy(lora_model, sampler, prompts):
    _train_one_step(lora_model, sampler.sample(prompts, PARAMS))
    CheckpointEngineManager(lora_model, sampler).sync_weights(merge_and_sync=True)
    response = sampler.sample(prompts, PARAMS)  # no adapter: the merged base
    assert _max_logprob_gap(lora_model, response) <= 1e-5
    assert sampler.adapter_names == []


def test_full_parameter_models_sync_their_weights(sampler, prompts):
    torch.manual_seed(0)
    model = TransformersModel(device="cpu", dtype=torch.float64)  # as the fixtures (see conftest.py)
    model.set_optimizer("AdamW", lr=1e-2)
    _train_one_step(model, sampler.sample(prompts, PARAMS))
    manager = CheckpointEngineManager(model, sampler)
    with pytest.raises(ConfigurationError, match="no LoRA adapter to sync"):
        manager.sync_weights()
    manager.sync_weights(merge_and_sync=True)
    assert _max_logprob_gap(model, sampler.sample(prompts, PARAMS), adapter_name=None) <= 1e-5


class Spy:
    """Wraps a sampler and counts the bytes of every tensor handed to it."""

    def __init__(self, sampler):
        self.sampler, self.bytes = sampler, 0

    def add_adapter(self, name, config, state_dict):
        self.bytes += sum(t.numel() * t.element_size() for t in state_dict.values())
        self.sampler.add_adapter(name, config, state_dict)

    def load_base_weights(self, weights):
        def counted():
            for name, tensor in weights:
                self.bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        return self.sampler.load_base_weights(counted())

    def reset_prefix_cache(self):
        self.sampler.reset_prefix_cache()


def test_lora_sync_moves_only_the_adapter_bytes(lora_model, sampler):
    lora_bytes = sum(p.numel() * p.element_size() for n, p in lora_model.model.named_parameters() if "lora_" in n)
    model_bytes = sum(p.numel() * p.element_size() for p in sampler.model.parameters())
    spy = Spy(sampler)
    CheckpointEngineManager(lora_model, spy).sync_weights()
    assert spy.bytes == lora_bytes and spy.bytes < model_bytes / 20
    full = Spy(sampler)
    CheckpointEngineManager(lora_model, full).sync_weights(merge_and_sync=True)
    assert full.bytes == model_bytes, "every base weight once, tied embeddings included once"


def test_misconfigured_syncs_are_refused(lora_model, sampler):
    with pytest.raises(ConfigurationError, match="no adapter 'other'"):
        CheckpointEngineManager(lora_model, sampler, adapter_name="other")
    lora_model.add_adapter_to_model("second", {"r": 2, "target_modules": ["q_proj"]})
    with pytest.raises(ConfigurationError, match="several adapters"):
        CheckpointEngineManager(lora_model, sampler)

    class LoraOnly:
        def add_adapter(self, name, config, state_dict):
            pass

    manager = CheckpointEngineManager(lora_model, LoraOnly(), adapter_name="second")
    manager.sync_weights()
    with pytest.raises(
        ConfigurationError, match=r"LoraOnly cannot receive merged weights: it has no load_base_weights"
    ):
        manager.sync_weights(merge_and_sync=True)
