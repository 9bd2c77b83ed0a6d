"""The semantic training API as a user drives it: full-parameter and multi-adapter training, components, metrics."""

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.loss import CrossEntropyLoss
from twinkle.model import TransformersModel
from twinkle.module import CosineWarmupScheduler
from twinkle.processor import InputProcessor

TRAJECTORY = {
    "messages": [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Twinkle, trained by ModelScope."},
    ]
}


def _lora_params(model, name):
    return {n: p for n, p in model.model.named_parameters() if "lora_" in n and f".{name}." in n}


def _clone(params, attribute="data"):
    return {n: None if getattr(p, attribute) is None else getattr(p, attribute).clone() for n, p in params.items()}


def _equal(params, saved, attribute="data"):
    return all(
        (saved[n] is None and getattr(p, attribute) is None) or torch.equal(getattr(p, attribute), saved[n])
        for n, p in params.items()
    )


def test_full_parameter_training_lowers_the_loss_and_saves_a_transformers_directory(short_features, tmp_path):
    torch.manual_seed(0)
    model = TransformersModel(device="cpu")
    model.set_optimizer("AdamW", lr=1e-3)
    losses = []
    for _ in range(3):
        losses.append(model.forward_backward(inputs=short_features).loss)
        assert model.clip_grad_and_step()["stepped"]
    losses.append(model.forward_only(inputs=short_features).loss)
    assert all(later < earlier for earlier, later in pairwise(losses)), losses

    path = Path(model.save("full", output_dir=tmp_path))
    assert (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = model.forward_only(inputs=short_features, return_logits=True).logits
    for feature, logits in zip(short_features, ours, strict=True):
        with torch.no_grad():
            reference = reloaded(input_ids=torch.tensor([feature["input_ids"]])).logits[0]
        torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def test_two_adapters_train_apart(new_lora_model, short_features):
    model = new_lora_model("first", "second")
    params = {name: _lora_params(model, name) for name in ("first", "second")}
    for name in ("first", "second"):
        model.set_optimizer("SGD", lr=0.1, adapter_name=name)
    with pytest.raises(ConfigurationError, match=r"several adapters \['first', 'second'\]: pass adapter_name="):
        model.forward_backward(inputs=short_features)
    logps_first = model.forward_only(inputs=short_features[:1], adapter_name="first").logps[0]
    logps_second = model.forward_only(inputs=short_features[:1], adapter_name="second").logps[0]
    assert not torch.equal(logps_first, logps_second)

    model.forward_backward(inputs=short_features, adapter_name="first")
    assert all(p.grad is not None for p in params["first"].values())
    assert all(p.grad is None for p in params["second"].values())
    grads_first, weights_first = _clone(params["first"], "grad"), _clone(params["first"])

    model.forward_backward(inputs=short_features, adapter_name="second")
    weights_second = _clone(params["second"])
    assert model.clip_grad_and_step(adapter_name="second")["stepped"]
    assert not _equal(params["second"], weights_second)
    assert _equal(params["first"], weights_first) and _equal(params["first"], grads_first, "grad")

    weights_second = _clone(params["second"])
    assert model.clip_grad_and_step(adapter_name="first")["stepped"]
    assert not _equal(params["first"], weights_first)
    assert _equal(params["second"], weights_second) and all(p.grad is None for p in params["second"].values())


def test_components_resolve_from_a_name_a_class_or_an_instance(new_lora_model, short_features):
    model = new_lora_model()
    mean = model.forward_only(inputs=short_features)
    for spec, kwargs in (
        ("CrossEntropyLoss", {"reduction": "token_sum"}),
        (CrossEntropyLoss, {"reduction": "token_sum"}),
        (CrossEntropyLoss(reduction="token_sum"), {}),
    ):
        model.set_loss(spec, **kwargs)
        assert model.forward_only(inputs=short_features).loss == pytest.approx(mean.loss * mean.num_tokens, rel=1e-5)

    for spec, kwargs in (
        ("InputProcessor", {"max_length": 12}),
        (InputProcessor, {"max_length": 12}),
        (InputProcessor(max_length=12), {}),
    ):
        model.set_processor(spec, **kwargs)
        model.forward_only(inputs=short_features[:3])
        with pytest.raises(InvalidInputError, match="max_length"):
            model.forward_only(inputs=short_features)  # the fourth is 13 tokens long
    with pytest.raises(ConfigurationError, match="already an instance"):
        model.set_processor(InputProcessor(), padding_free=True)

    for spec, lr in (("SGD", 0.5), (torch.optim.SGD, 0.25)):
        model.set_optimizer(spec, lr=lr)
        assert model.calculate_metric()["lr"] == lr
    with pytest.raises(ConfigurationError, match="not an instance"):
        model.set_optimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))

    model.set_lr_scheduler("LinearWarmupScheduler", num_warmup_steps=4, num_training_steps=8)
    assert model.calculate_metric()["lr"] == 0.0  # warm-up starts from zero
    model.set_lr_scheduler(CosineWarmupScheduler, num_warmup_steps=2, num_training_steps=8)
    model.forward_backward(inputs=short_features[:1])
    assert model.clip_grad_and_step()["lr"] == pytest.approx(0.125)  # half-way through the warm-up of lr 0.25
    other_optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="not an instance"):
        model.set_lr_scheduler(CosineWarmupScheduler(other_optimizer))


def test_changing_the_optimizer_mid_run(new_lora_model, short_features):
    model = new_lora_model()
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_training_steps=10)
    model.forward_backward(inputs=short_features)
    model.clip_grad_and_step()

    model.set_optimizer("SGD", lr=0.1)  # drops the scheduler, which belonged to the old optimizer
    model.forward_backward(inputs=short_features)
    params = _lora_params(model, "default")
    weights, grads = _clone(params), _clone(params, "grad")
    result = model.clip_grad_and_step(max_grad_norm=1e9)
    assert result["stepped"] and result["global_step"] == 2 and result["lr"] == 0.1
    for name, param in params.items():  # plain SGD: w - lr * g
        torch.testing.assert_close(param.data, weights[name] - 0.1 * grads[name], atol=1e-7, rtol=0)


def test_clip_grad_and_step_steps_once_per_gradient_accumulation_steps(new_lora_model, short_features):
    model = new_lora_model(gradient_accumulation_steps=3)
    model.set_optimizer("SGD", lr=0.1)
    params = _lora_params(model, "default")
    results = []
    for index in range(6):
        weights = _clone(params)
        model.forward_backward(inputs=short_features[index % 4 : index % 4 + 1])
        results.append(model.clip_grad_and_step())
        assert _equal(params, weights) != results[-1]["stepped"]
    assert [r["stepped"] for r in results] == [False, False, True, False, False, True]
    assert results[0] == {"stepped": False, "accumulated": 1} and results[1] == {"stepped": False, "accumulated": 2}
    assert results[-1]["global_step"] == 2

    model.forward_backward(inputs=short_features[:1])
    model.zero_grad()  # dropped gradients no longer count
    model.forward_backward(inputs=short_features[:1])
    assert model.clip_grad_and_step() == {"stepped": False, "accumulated": 1}


def test_calculate_metric_reports_the_calls_since_the_last_one_and_resets(new_lora_model, short_features):
    model = new_lora_model()
    model.set_optimizer("AdamW", lr=1e-3)
    evaluated = model.forward_only(inputs=short_features, return_logits=True)
    correct = supervised = 0
    for feature, logits in zip(short_features, evaluated.logits, strict=True):
        labels = torch.tensor(feature["labels"][1:])
        mask = labels != -100
        correct += int((logits[:-1].argmax(-1)[mask] == labels[mask]).sum())
        supervised += int(mask.sum())

    output = model.forward_backward(inputs=short_features)
    step = model.clip_grad_and_step()
    metric = model.calculate_metric()
    assert metric["loss"] == pytest.approx(output.loss)
    assert metric["accuracy"] == correct / supervised
    assert metric["num_supervised_tokens"] == supervised == output.num_tokens
    assert metric["num_tokens"] == sum(len(f["input_ids"]) for f in short_features)
    assert metric["grad_norm"] == pytest.approx(step["grad_norm"])
    assert metric["lr"] == 1e-3 and metric["global_step"] == 1
    assert metric["tokens_per_second"] > 0
    assert model.calculate_metric() == {"lr": 1e-3, "global_step": 1.0}

    evaluation = model.calculate_metric(is_training=False)
    assert evaluation["loss"] == pytest.approx(evaluated.loss) and evaluation["accuracy"] == correct / supervised
    assert "loss" not in model.calculate_metric(is_training=False)


def test_forward_only_leaves_gradients_alone_and_training_mode_on(new_lora_model, short_features):
    model = new_lora_model(lora_dropout=0.5)
    first = model.forward_only(inputs=short_features)
    assert all(p.grad is None for p in model.model.parameters())
    assert model.model.training and not first.logps[0].requires_grad
    second = model.forward_only(inputs=short_features)  # dropout is off inside forward_only
    assert all(torch.equal(a, b) for a, b in zip(first.logps, second.logps, strict=True))

    model.forward_backward(inputs=short_features[:2])
    params = _lora_params(model, "default")
    grads = _clone(params, "grad")
    model.forward_only(inputs=short_features)
    assert _equal(params, grads, "grad") and model.model.training


def test_trajectories_are_encoded_with_the_adapters_template(new_lora_model, template):
    model = new_lora_model()
    with pytest.raises(ConfigurationError, match=r"inputs\[0\] is a trajectory; call set_template"):
        model.forward_backward(inputs=[TRAJECTORY])
    model.set_template("Template", max_length=128)
    from_trajectory = model.forward_only(inputs=[TRAJECTORY])
    from_feature = model.forward_only(inputs=[template.encode(TRAJECTORY)])
    assert torch.equal(from_trajectory.logps[0], from_feature.logps[0]) and from_trajectory.num_tokens > 0
    assert model.forward_backward(inputs=[TRAJECTORY]).loss == pytest.approx(from_feature.loss, rel=1e-5)


def test_generate_returns_the_greedy_continuation_as_token_ids(new_lora_model, template):
    model = new_lora_model()
    prompt = template.encode(TRAJECTORY, add_generation_prompt=True)["input_ids"]
    tokens = model.generate(prompt, max_new_tokens=4)
    assert isinstance(tokens, list) and 1 <= len(tokens) <= 4
    assert all(isinstance(t, int) and 0 <= t < model.vocab_size for t in tokens)
    logits = model.forward_only(inputs=[{"input_ids": prompt}], return_logits=True).logits[0]
    assert tokens[0] == int(logits[-1].argmax())
    assert model.model.training


def test_rl_loss_reads_logps_without_inputs_and_reports_its_metrics(lora_config, sft_features):
    """forward_only skips a loss whose required inputs are missing; a loss's metrics reach the caller."""
    model = TransformersModel(device="cpu")
    model.add_adapter_to_model("default", lora_config)
    model.set_loss("GRPOLoss", epsilon=0.2)
    model.set_optimizer("AdamW", lr=1e-3)
    old = model.forward_only(inputs=sft_features[:4])
    assert old.loss is None and len(old.logps) == 4
    out = model.forward_backward(
        inputs=sft_features[:4], advantages=[1.0, -1.0, 0.5, -0.5], old_logps=old.logps, micro_batch_size=2
    )
    assert out.metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert {"clip_low_fraction", "clip_high_fraction", "approx_kl"} <= set(out.metrics)
    model.clip_grad_and_step()
    assert model.calculate_metric()["loss/ratio"] == pytest.approx(1.0, abs=1e-5)


def test_a_seeded_adapter_is_reproducible_and_leaves_the_random_stream_alone(lora_config):
    adapters = []
    for _ in range(2):
        model = TransformersModel(device="cpu")
        torch.manual_seed(1)
        before = torch.get_rng_state()
        model.add_adapter_to_model("a", lora_config, seed=7)
        assert torch.equal(torch.get_rng_state(), before)
        adapters.append(_clone(_lora_params(model, "a")))
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    assert all(torch.equal(value, adapters[1][name]) for name, value in adapters[0].items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_seeded_adapter_on_cuda_leaves_the_cuda_random_stream_alone(lora_config):
    model = TransformersModel(device="cuda")
    before = torch.cuda.get_rng_state()
    model.add_adapter_to_model("a", lora_config, seed=7)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    first = _clone(_lora_params(model, "a"))
    model.add_adapter_to_model("b", lora_config, seed=7)
    second = {name.replace(".b.", ".a."): value for name, value in _clone(_lora_params(model, "b")).items()}
    assert first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)
