"""Per-row LoRA adapters: isolation inside one batch, PEFT formats and scaling, adapter lifecycle."""

import pytest
import torch
from peft import LoraConfig

from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.errors import ConfigurationError, InvalidInputError

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def two_tenants(trained_model):
    return trained_model("small", "large")  # ranks 4 and 8


def test_each_row_gets_exactly_what_it_gets_alone(sampler, prompts, two_tenants, lora_of):
    for name in ("small", "large"):
        sampler.add_adapter(name, *lora_of(two_tenants, name))
    rows = [(0, None), (1, "small"), (2, "large"), (1, None), (0, "large"), (3, "small")]
    mixed = sampler.sample([prompts[p] for p, _ in rows], GREEDY, adapter_name=[a for _, a in rows])
    for (prompt, adapter), together in zip(rows, mixed.sequences, strict=True):
        (alone,) = sampler.sample(prompts[prompt], GREEDY, adapter_name=[adapter]).sequences  # [None]: the base
        assert together.tokens == alone.tokens, (prompt, adapter)
        assert max(abs(a - b) for a, b in zip(together.logprobs, alone.logprobs, strict=True)) <= 1e-5
    by_adapter = {adapter: s.tokens for (p, adapter), s in zip(rows, mixed.sequences, strict=True) if p == 1}
    assert by_adapter["small"] != by_adapter[None], "the adapter really changes the row"


def test_a_saved_adapter_directory_loads_like_its_tensors(sampler, prompts, two_tenants, lora_of, tmp_path):
    path = two_tenants.save("ckpt", output_dir=tmp_path, save_optimizer=False, adapter_name="large")
    sampler.load_adapter("from_disk", path)
    sampler.add_adapter("from_memory", *lora_of(two_tenants, "large"))
    disk = sampler.sample(prompts[:2], GREEDY, adapter_name="from_disk")
    memory = sampler.sample(prompts[:2], GREEDY, adapter_name="from_memory")
    assert [s.logprobs for s in disk.sequences] == [s.logprobs for s in memory.sequences]


@pytest.mark.parametrize(
    "config",
    [
        {"r": 4, "lora_alpha": 16, "use_rslora": True},
        {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 2}, "alpha_pattern": {"v_proj": 3}},
    ],
    ids=["rslora", "rank-and-alpha-patterns"],
)
def test_per_module_scaling_matches_peft(sampler, prompts, lora_of, config):
    from twinkle.model import TransformersModel

    model = TransformersModel(device="cpu")
    model.add_adapter_to_model("tenant", LoraConfig(target_modules="all-linear", lora_dropout=0.0, **config))
    with torch.no_grad():
        for name, param in model.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    sampler.add_adapter("tenant", *lora_of(model, "tenant"))
    response = sampler.sample(prompts[:2], SamplingParams(max_tokens=6, seed=0), adapter_name="tenant")
    features = [s.new_input_feature for s in response.sequences]
    trainer = model.forward_only(inputs=features, adapter_name="tenant").logps
    for sequence, logps, feature in zip(response.sequences, trainer, features, strict=True):
        expected = logps[torch.tensor(feature["labels"]) != IGNORE_INDEX].tolist()
        assert max(abs(a - b) for a, b in zip(sequence.logprobs, expected, strict=True)) <= 1e-5


def test_replacing_an_adapter_takes_a_snapshot_of_the_new_weights(sampler, prompts, two_tenants, lora_of):
    config, state_dict = lora_of(two_tenants, "small")
    sampler.add_adapter("tenant", config, state_dict)
    before = sampler.sample(prompts[0], GREEDY, adapter_name="tenant").sequences[0].logprobs
    with torch.no_grad():
        for tensor in state_dict.values():
            tensor.mul_(1.5)  # the trainer updates its adapter in place ...
        assert sampler.sample(prompts[0], GREEDY, adapter_name="tenant").sequences[0].logprobs == before
        sampler.add_adapter("tenant", config, state_dict)  # ... and the sampler sees it only once synced
        after = sampler.sample(prompts[0], GREEDY, adapter_name="tenant").sequences[0].logprobs
        for tensor in state_dict.values():
            tensor.div_(1.5)
    assert after != before and sampler.adapter_names == ["tenant"]


def test_removed_adapters_are_gone(sampler, prompts, two_tenants, lora_of):
    sampler.add_adapter("tenant", *lora_of(two_tenants, "small"))
    sampler.remove_adapter("tenant")
    assert sampler.adapter_names == []
    assert all(not m.adapters for m in sampler.model.modules() if hasattr(m, "adapters"))
    with pytest.raises(InvalidInputError, match="unknown adapter 'tenant'"):
        sampler.sample(prompts[0], GREEDY, adapter_name="tenant")
    with pytest.raises(InvalidInputError, match="unknown adapter 'tenant'"):
        sampler.remove_adapter("tenant")


def test_adapters_it_cannot_serve_are_refused_by_name(sampler, two_tenants, lora_of):
    config, state_dict = lora_of(two_tenants, "small")
    with pytest.raises(ConfigurationError, match="DoRA"):
        sampler.add_adapter("dora", {"r": 4, "lora_alpha": 8, "use_dora": True}, state_dict)
    with pytest.raises(ConfigurationError, match="not a LoRA A/B weight"):
        sampler.add_adapter("odd", config, {**state_dict, "base_model.model.lm_head.modules_to_save.weight": None})
    key = next(iter(state_dict))
    moved = {key.replace("layers.0.", "layers.99."): value for key, value in state_dict.items()}
    with pytest.raises(ConfigurationError, match="not linear layers"):
        sampler.add_adapter("odd", config, moved)
    with pytest.raises(ConfigurationError, match="not its partner"):
        sampler.add_adapter("odd", config, {key: state_dict[key]})
    assert sampler.adapter_names == []
