"""A bad call raises an error that names the problem and leaves the model exactly as it was.

"Exactly": weights and accumulated gradients bit-equal, optimizer and scheduler
state and counters unchanged, the same components in place, and nothing
recorded for ``calculate_metric``.
"""

import copy
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from peft import LoraConfig

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ComponentNotFoundError, ConfigurationError, InvalidInputError
from twinkle.loss import CrossEntropyLoss
from twinkle.model import TransformersModel

VOCAB_SIZE = 151936  # the builtin tiny Qwen3


@pytest.fixture(scope="module")
def trained(new_lora_model, short_features):
    """One step taken (optimizer and scheduler have state) and gradients accumulated for the next."""
    model = new_lora_model()
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=10)
    model.forward_backward(inputs=short_features)
    model.clip_grad_and_step()
    model.forward_backward(inputs=short_features)
    return model


@pytest.fixture(scope="module")
def without_optimizer(new_lora_model, short_features):
    """Gradients accumulated, no optimizer set."""
    model = new_lora_model()
    model.forward_backward(inputs=short_features)
    return model


def _snapshot(model):
    state = model.train_state(None)
    return {
        "weights": {n: p.detach().clone() for n, p in model.model.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None},
        "optimizer": copy.deepcopy(state.optimizer.state_dict()) if state.optimizer else None,
        "lr_scheduler": copy.deepcopy(state.lr_scheduler.state_dict()) if state.lr_scheduler else None,
        "counters": state.counters(),
        "adapters": model.adapter_names,
        "training": model.model.training,
    }


def _components(model):
    state = model.train_state(None)
    return [state.optimizer, state.lr_scheduler, state.loss, state.processor, state.template, state.pending]


def _assert_equal(before, after, where="model"):
    if torch.is_tensor(before):
        assert torch.is_tensor(after) and before.dtype == after.dtype and torch.equal(before, after), where
    elif isinstance(before, dict):
        assert before.keys() == after.keys(), where
        for key in before:
            _assert_equal(before[key], after[key], f"{where}[{key!r}]")
    elif isinstance(before, (list, tuple)):
        assert len(before) == len(after), where
        for index, (old, new) in enumerate(zip(before, after, strict=True)):
            _assert_equal(old, new, f"{where}[{index}]")
    else:
        assert before == after, where


@contextmanager
def _unchanged(model):
    model.calculate_metric(is_training=True)  # start from empty metrics
    model.calculate_metric(is_training=False)
    before, components = _snapshot(model), _components(model)
    yield
    _assert_equal(before, _snapshot(model))
    assert all(old is new for old, new in zip(components, _components(model), strict=True))
    for is_training in (True, False):
        assert set(model.calculate_metric(is_training=is_training)) <= {"lr", "global_step"}


def _edit(feature, **fields):
    edited = copy.deepcopy(dict(feature))
    for name, (index, value) in fields.items():
        edited[name][index] = value
    return edited


def _unsupervised(feature):
    return {**feature, "labels": [IGNORE_INDEX] * len(feature["labels"]), "loss_mask": [0] * len(feature["labels"])}


def _labels_shorter(feature):
    return {**feature, "labels": feature["labels"][:-1], "loss_mask": feature["loss_mask"][:-1]}


def _lora():
    return LoraConfig(r=2, target_modules="all-linear")


VOCAB = r"outside the vocabulary \[0, 151936\)"
# (call on model and the four short features, error type, message pattern)
BAD_CALLS = {
    "id_equal_to_vocab_size": (
        lambda m, f: m.forward_backward(inputs=[f[0], _edit(f[1], input_ids=(2, VOCAB_SIZE))]),
        InvalidInputError,
        rf"inputs\[1\]\.input_ids contains ids {VOCAB}: \[151936\]",
    ),
    "negative_id": (
        lambda m, f: m.forward_backward(inputs=[_edit(f[0], input_ids=(0, -1)), f[1]]),
        InvalidInputError,
        rf"inputs\[0\]\.input_ids contains ids {VOCAB}: \[-1\]",
    ),
    "label_not_its_token": (  # labels are unshifted, so one outside the vocabulary is caught here too
        lambda m, f: m.forward_backward(inputs=[f[0], _edit(f[1], labels=(-1, 10**6))]),
        InvalidInputError,
        r"features\[1\]\.labels\[10\]=1000000 but input_ids\[10\]=\d+: labels must be unshifted",
    ),
    "empty_batch": (lambda m, f: m.forward_backward(inputs=[]), InvalidInputError, "inputs is empty"),
    "no_supervised_token": (
        lambda m, f: m.forward_backward(inputs=[_unsupervised(x) for x in f]),
        InvalidInputError,
        "no supervised token",
    ),
    "labels_shorter_than_input_ids": (
        lambda m, f: m.forward_backward(inputs=[f[0], _labels_shorter(f[1])]),
        InvalidInputError,
        r"inputs\[1\]\.labels has length 10 but input_ids has length 11",
    ),
    "loss_input_of_wrong_length": (
        lambda m, f: m.forward_backward(inputs=f, advantages=[1.0]),
        InvalidInputError,
        "'advantages' has 1 entries but the batch has 4 samples",
    ),
    "loss_input_array_of_wrong_length": (  # once shared by both micro-batches, lining up with each of them
        lambda m, f: m.forward_backward(inputs=f, advantages=np.array([1.0, -1.0]), micro_batch_size=2),
        InvalidInputError,
        "'advantages' has 2 entries but the batch has 4 samples",
    ),
    "loss_input_tensor_of_wrong_length": (
        lambda m, f: m.forward_backward(inputs=f, advantages=torch.tensor([1.0, -1.0]), micro_batch_size=2),
        InvalidInputError,
        "'advantages' has 2 entries but the batch has 4 samples",
    ),
    "loss_input_0d_tensor": (  # a scalar, handed to the loss as it is (once a TypeError from len())
        lambda m, f: m.forward_backward(inputs=f, advantages=torch.tensor(1.0), micro_batch_size=2),
        InvalidInputError,
        r"CrossEntropyLoss takes no extra inputs, got \['advantages'\]",
    ),
    "loss_input_the_loss_does_not_take": (
        lambda m, f: m.forward_backward(inputs=f, advantages=[1.0] * 4),
        InvalidInputError,
        r"CrossEntropyLoss takes no extra inputs, got \['advantages'\]",
    ),
    "micro_batch_size_zero": (
        lambda m, f: m.forward_backward(inputs=f, micro_batch_size=0),
        InvalidInputError,
        "micro_batch_size must be a positive int, got 0",
    ),
    "forward_with_bad_id": (
        lambda m, f: m.forward(inputs=[_edit(f[0], input_ids=(1, VOCAB_SIZE + 5))]),
        InvalidInputError,
        VOCAB,
    ),
    "forward_only_with_bad_id": (
        lambda m, f: m.forward_only(inputs=[_edit(f[0], input_ids=(1, -7))]),
        InvalidInputError,
        VOCAB,
    ),
    "forward_only_with_bad_loss_input": (
        lambda m, f: m.forward_only(inputs=f, ref_logps=[0.0] * 4),
        InvalidInputError,
        "CrossEntropyLoss takes no extra inputs",
    ),
    "unknown_optimizer": (
        lambda m, f: m.set_optimizer("NoSuchOptimizer", lr=1e-3),
        ComponentNotFoundError,
        "unknown optimizer 'NoSuchOptimizer'",
    ),
    "invalid_learning_rate": (
        lambda m, f: m.set_optimizer("AdamW", lr=-1.0),
        ConfigurationError,
        "Invalid learning rate",
    ),
    "unknown_loss": (lambda m, f: m.set_loss("NoSuchLoss"), ComponentNotFoundError, "unknown loss 'NoSuchLoss'"),
    "unknown_lr_scheduler": (
        lambda m, f: m.set_lr_scheduler("NoSuchScheduler"),
        ComponentNotFoundError,
        "unknown lr_scheduler 'NoSuchScheduler'",
    ),
    "lr_scheduler_with_bad_arguments": (
        lambda m, f: m.set_lr_scheduler("CosineWarmupScheduler", num_training_steps=0),
        ConfigurationError,
        r"num_training_steps \(0\)",
    ),
    "unknown_processor": (
        lambda m, f: m.set_processor("NoSuchProcessor"),
        ComponentNotFoundError,
        "unknown processor 'NoSuchProcessor'",
    ),
    "loss_instance_with_arguments": (
        lambda m, f: m.set_loss(CrossEntropyLoss(), reduction="token_sum"),
        ConfigurationError,
        r"already an instance; arguments \['reduction'\] would be ignored",
    ),
    "unknown_adapter_name": (
        lambda m, f: m.forward_backward(inputs=f, adapter_name="nope"),
        ConfigurationError,
        r"unknown adapter 'nope'; adapters: \['default'\]",
    ),
    "duplicate_adapter_name": (
        lambda m, f: m.add_adapter_to_model("default", _lora()),
        ConfigurationError,
        "adapter 'default' already exists; pick another name",
    ),
    "adapter_name_with_a_dot": (
        lambda m, f: m.add_adapter_to_model("my.adapter", _lora()),
        ConfigurationError,
        "without dots, got 'my.adapter'",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_call_names_the_problem_and_changes_nothing(trained, short_features, case):
    call, error, message = BAD_CALLS[case]
    with _unchanged(trained), pytest.raises(error, match=message):
        call(trained, short_features)


NO_OPTIMIZER_CALLS = {
    "step": lambda m: m.step(),
    "clip_grad_and_step": lambda m: m.clip_grad_and_step(),
    "set_lr_scheduler": lambda m: m.set_lr_scheduler("CosineWarmupScheduler", num_training_steps=10),
}


@pytest.mark.parametrize("case", NO_OPTIMIZER_CALLS)
def test_calls_that_need_an_optimizer_say_so(without_optimizer, case):
    with _unchanged(without_optimizer), pytest.raises(ConfigurationError, match=r"no optimizer .*set_optimizer"):
        NO_OPTIMIZER_CALLS[case](without_optimizer)


class NonFiniteOnSecondCall(CrossEntropyLoss):
    """Cross-entropy whose second micro-batch comes out NaN, as an overflow would."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __call__(self, inputs, outputs, normalizer=None, **loss_inputs):
        self.calls += 1
        result = super().__call__(inputs, outputs, normalizer, **loss_inputs)
        if self.calls == 2:
            result.loss = result.loss * float("nan")
        return result


def test_non_finite_loss_restores_the_gradients_of_earlier_micro_batches(trained, short_features):
    original_loss = trained.train_state(None).loss
    loss = NonFiniteOnSecondCall()
    trained.set_loss(loss)
    try:
        with (
            _unchanged(trained),
            pytest.raises(InvalidInputError, match=r"NonFiniteOnSecondCall is not finite \(nan\)"),
        ):
            trained.forward_backward(inputs=short_features, micro_batch_size=2)
    finally:
        trained.set_loss(original_loss)
    assert loss.calls == 2  # the first micro-batch did back-propagate before the failure


def test_failed_call_does_not_turn_a_fresh_model_into_full_parameter_training(short_features):
    base = TransformersModel(device="cpu")
    with pytest.raises(ConfigurationError, match="no optimizer for the model"):
        base.step()
    base.forward_only(inputs=short_features[:1])  # evaluating the base model first is fine too
    base.add_adapter_to_model("default", _lora())
    assert base.adapter_names == ["default"]

    configured = TransformersModel(device="cpu")
    configured.set_loss("CrossEntropyLoss", reduction="token_sum")  # a choice adapters would silently drop
    with pytest.raises(ConfigurationError, match="set up for full-parameter training"):
        configured.add_adapter_to_model("default", _lora())


def test_a_pairwise_loss_call_is_never_cut_into_micro_batches(new_lora_model, short_features):
    """Two pairs (chosen 0 1, rejected 2 3): micro-batches of 2 would pair chosen 0 with chosen 1."""
    model = new_lora_model()
    model.set_loss("DPOLoss")
    with _unchanged(model), pytest.raises(InvalidInputError, match=r"DPOLoss pairs .* micro_batch_size=None"):
        model.forward_backward(inputs=short_features, ref_logps=[0.0] * 4, micro_batch_size=2)
    assert model.forward_backward(inputs=short_features, ref_logps=[0.0] * 4, micro_batch_size=4).loss > 0
