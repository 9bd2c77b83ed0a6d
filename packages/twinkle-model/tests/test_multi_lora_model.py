"""MultiLoraModel adapters: lifecycle, PEFT-format checkpoints, limits, and weight sync into a sampler."""

import gc
import weakref

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.model import MultiLoraModel

CONFIGS = {
    "wide": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    "attn": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


def _randomize_B(model: MultiLoraModel, name: str, seed: int) -> None:
    """LoRA starts as the identity (B = 0); random B makes the adapter change the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, tensor in model.lora_payload(name)[1].items():
            if "lora_B" in key:
                tensor.normal_(0, 0.1, generator=generator)


@pytest.fixture
def multi():
    torch.manual_seed(0)
    model = MultiLoraModel(device="cpu", max_loras=3, max_rank=8)
    for seed, (name, config) in enumerate(CONFIGS.items()):
        model.add_adapter_to_model(name, config)
        _randomize_B(model, name, seed)
    return model


def _peft_logits(path, features):
    base = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        return [plain(input_ids=torch.tensor([f["input_ids"]])).logits[0] for f in features]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_saved_adapter_loads_in_plain_peft_with_equal_logits(multi, name, short_features, tmp_path):
    multi.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
    multi.forward_backward(short_features, adapter_name=name)
    multi.clip_grad_and_step(adapter_name=name)
    path = multi.save("ckpt", output_dir=tmp_path, adapter_name=name)
    ours = multi.forward_only(short_features, adapter_name=name, return_logits=True).logits
    for logits, reference in zip(ours, _peft_logits(path, short_features), strict=True):
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_a_peft_adapter_loads_with_equal_logits(short_features, tmp_path):
    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["k_proj", "down_proj"], rank_pattern={"down_proj": 2})
    plain = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=generator) * 0.1 for k, v in plain.state_dict().items() if "lora_" in k}
    set_peft_model_state_dict(plain, {k.replace(".default", ""): v for k, v in state.items()})
    plain.save_pretrained(tmp_path / "peft")

    model = MultiLoraModel(device="cpu")
    model.add_adapter_to_model("tenant", tmp_path / "peft")
    ours = model.forward_only(short_features, return_logits=True).logits
    for logits, reference in zip(ours, _peft_logits(tmp_path / "peft", short_features), strict=True):
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_adapters_come_and_go_without_touching_the_base_or_each_other(multi, short_features, tmp_path):
    kept = multi.forward_only(short_features, adapter_name="wide").logps
    base_weights = {k: v.clone() for k, v in multi.model.state_dict().items()}
    path = multi.save("attn-ckpt", output_dir=tmp_path, adapter_name="attn", save_optimizer=False)
    before = multi.forward_only(short_features, adapter_name="attn").logps

    multi.set_optimizer("AdamW", adapter_name="attn", lr=1e-2)
    multi.forward_backward(short_features, adapter_name="attn")
    tensors = [weakref.ref(t) for t in multi.lora_payload("attn")[1].values()]
    optimizer = weakref.ref(multi.train_state("attn").optimizer)
    multi.remove_adapter("attn")
    gc.collect()
    assert all(ref() is None for ref in [*tensors, optimizer]), "a removed adapter's memory must be released"
    assert multi.adapter_names == ["wide"]
    with pytest.raises(ConfigurationError, match=r"unknown adapter 'attn'"):
        multi.forward_only(short_features, adapter_name="attn")

    multi.add_adapter_to_model("attn", path)  # re-added from its checkpoint, base untouched
    for a, b in zip(multi.forward_only(short_features, adapter_name="attn").logps, before, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for a, b in zip(multi.forward_only(short_features, adapter_name="wide").logps, kept, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for key, value in multi.model.state_dict().items():
        assert torch.equal(value, base_weights[key]), key


def test_limits_and_unsupported_options_are_named():
    model = MultiLoraModel(device="cpu", max_loras=1, max_rank=4)
    with pytest.raises(ConfigurationError, match=r"rank 8 of .*q_proj is outside 1\.\.4"):
        model.add_adapter_to_model("big", LoraConfig(r=8, target_modules=["q_proj"]))
    with pytest.raises(ConfigurationError, match=r"uses DoRA"):
        model.add_adapter_to_model("dora", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ConfigurationError, match=r"ensure_weight_tying"):
        model.add_adapter_to_model("tied", LoraConfig(r=2, target_modules=["lm_head"], ensure_weight_tying=True))
    with pytest.raises(ConfigurationError, match=r"'all-linear' is a shorthand only as the whole target_modules"):
        model.add_adapter_to_model("mixed", LoraConfig(r=2, target_modules=["all-linear", "lm_head"]))
    with pytest.raises(ConfigurationError, match=r"match no linear layer"):
        model.add_adapter_to_model("none", LoraConfig(r=2, target_modules=["no_such_proj"]))
    with pytest.raises(ConfigurationError, match=r"trains LoRA adapters only"):
        model.set_optimizer("AdamW", lr=1e-3)
    assert model.adapter_names == []  # failed adds leave nothing behind
    model.add_adapter_to_model("one", LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigurationError, match=r"all 1 adapter slots are in use \(\['one'\]\)"):
        model.add_adapter_to_model("two", LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ConfigurationError, match=r"max_rank must be an int >= 1"):
        MultiLoraModel(max_rank=0)


def test_lora_dropout_is_per_adapter_and_only_in_training(short_features):
    torch.manual_seed(0)
    model = MultiLoraModel(device="cpu")
    model.add_adapter_to_model("dropped", LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.5))
    model.add_adapter_to_model("plain", LoraConfig(r=4, target_modules="all-linear"))
    for seed, name in enumerate(model.adapter_names):
        _randomize_B(model, name, seed)
    train = {
        name: [model.forward(short_features, adapter_name=name).logps.detach() for _ in range(2)]
        for name in ("dropped", "plain")
    }
    assert not torch.equal(*train["dropped"]), "dropout 0.5 must change the training forward"
    assert torch.equal(*train["plain"])
    evaluation = [model.forward_only(short_features, adapter_name="dropped").logps for _ in range(2)]
    for a, b in zip(*evaluation, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("merge_and_sync", [False, True])
def test_sync_into_a_sampler_gives_the_trainers_logprobs(multi, short_features, merge_and_sync):
    from twinkle.checkpoint_engine import CheckpointEngineManager
    from twinkle.data_format import SamplingParams
    from twinkle.sampler import TorchSampler

    multi.set_optimizer("AdamW", adapter_name="wide", lr=1e-2)
    multi.forward_backward(short_features, adapter_name="wide")
    multi.clip_grad_and_step(adapter_name="wide")
    sampler = TorchSampler(device="cpu")
    CheckpointEngineManager(multi, sampler, adapter_name="wide").sync_weights(merge_and_sync=merge_and_sync)
    prompts = [{"input_ids": f["input_ids"][:5]} for f in short_features]
    response = sampler.sample(
        prompts, SamplingParams(max_tokens=4, seed=0), adapter_name=None if merge_and_sync else "wide"
    )
    trained = multi.forward_only([s.new_input_feature for s in response.sequences], adapter_name="wide").logps
    for sequence, logps in zip(response.sequences, trained, strict=True):
        completion = logps[-len(sequence.tokens) :]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), completion, atol=1e-5, rtol=0)


def test_micro_batches_cut_each_request_as_it_would_be_cut_alone(short_features):
    """A pair-wise loss's request stays whole when it fits a micro-batch, whatever the other requests' sizes."""
    from twinkle.model import AdapterRequest

    def gradients(micro_batch_size):
        torch.manual_seed(0)
        model = MultiLoraModel(device="cpu")
        for seed, name in enumerate(("sft", "pref")):
            model.add_adapter_to_model(name, LoraConfig(r=4, target_modules="all-linear"))
            _randomize_B(model, name, seed)
        model.set_loss("SimPOLoss", adapter_name="pref")
        requests = [AdapterRequest("sft", short_features[:3]), AdapterRequest("pref", short_features[2:4])]
        results = model.forward_backward_many(requests, micro_batch_size=micro_batch_size)
        assert all(result.ok for result in results), [result.error for result in results]
        return [p.grad.clone() for name in ("sft", "pref") for p in model.train_state(name).params]

    for split, whole in zip(gradients(4), gradients(None), strict=True):
        torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)


def test_a_nan_gradient_behind_a_finite_loss_skips_the_step(short_features):
    from twinkle.data_format import LossOutput
    from twinkle.errors import InvalidInputError

    class SqrtAtZero:
        """Finite (0) in value, NaN in gradient: d/dx sqrt(|x|) at x = 0."""

        required_inputs = ()

        def normalizer(self, batch):
            return None

        def __call__(self, batch, output, **_):
            logps = output.logps[batch["labels"] != -100]
            return LossOutput(loss=torch.sqrt((logps - logps.detach()).abs()).sum(), metrics={})

    model = MultiLoraModel(device="cpu")
    model.add_adapter_to_model("a", LoraConfig(r=4, target_modules=["q_proj"]))
    model.set_optimizer("AdamW", adapter_name="a", lr=1e-2)
    model.set_loss(SqrtAtZero(), adapter_name="a")
    before = [p.detach().clone() for p in model.train_state("a").params]
    model.forward_backward(short_features, adapter_name="a")
    with pytest.raises(InvalidInputError, match=r"gradient norm is nan: the optimizer step was skipped"):
        model.clip_grad_and_step(adapter_name="a")
    state = model.train_state("a")
    assert state.global_step == 0 and state.accumulated == 0
    assert all(p.grad is None for p in state.params)
    assert all(torch.equal(p, b) for p, b in zip(state.params, before, strict=True))


def test_without_target_modules_the_architectures_peft_defaults_are_used():
    model = MultiLoraModel(device="cpu")
    model.add_adapter_to_model("default-targets", LoraConfig(r=2))
    reference = get_peft_model(AutoModelForCausalLM.from_pretrained(resolve_model(None)), LoraConfig(r=2))
    peft_modules = {name.split(".lora_A")[0] for name, _ in reference.named_parameters() if ".lora_A." in name}
    payload = model.lora_payload("default-targets")[1]
    ours = {key.removeprefix("base_model.model.").split(".lora_")[0] for key in payload}
    assert ours == {name.removeprefix("base_model.model.") for name in peft_modules}
