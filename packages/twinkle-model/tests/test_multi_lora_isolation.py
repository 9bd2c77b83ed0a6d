"""A failing request in ``forward_backward_many`` spoils nothing: not its own adapter, not the others' step.

Three adapters share each pass: ``x`` (cross-entropy), ``y`` (GRPO with
sampler log-probs) and ``bad`` (GRPO through a loss that fails on demand,
``gradient_accumulation_steps=2``). ``bad`` has taken an optimizer step and
holds gradients accumulated by an earlier call when one of its requests fails
— by a NaN or inf loss, a raising loss, bad inputs or loss inputs, also when
``micro_batch_size`` splits its rows and only the second micro-batch fails —
or when the failing request is another (an unknown adapter, an adapter named
twice, a malformed request). Then:

(a) that request's result is not ``ok`` and its error names the cause;
(b) ``bad``'s weights, gradients, optimizer and scheduler state, counters,
    components and metrics are bit-identical to before, and its next healthy
    step equals (bit for bit) the step of a model that never saw the failure;
(c) ``x`` and ``y`` get the losses, log-probs and gradients of the same call
    without the failing request.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from peft import LoraConfig

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.loss import GRPOLoss
from twinkle.model import AdapterRequest, MultiLoraModel

VOCAB_SIZE = 151936  # the builtin tiny Qwen3
TRIGGER = 4999  # a batch holding this token makes FailingLoss fail
CLOSE = {"atol": 1e-6, "rtol": 1e-6}


class FailingLoss(GRPOLoss):
    """GRPO, except on a (micro-)batch that holds the TRIGGER token: then its loss is NaN or inf, or it raises."""

    def __init__(self, kind: str = "nan") -> None:
        super().__init__()
        self.kind = kind

    def __call__(self, inputs, outputs, normalizer=None, **loss_inputs):
        output = super().__call__(inputs, outputs, normalizer, **loss_inputs)
        if not bool((inputs["input_ids"] == TRIGGER).any()):
            return output
        if self.kind == "raise":
            raise RuntimeError("tenant loss exploded")
        output.loss = output.loss + float("inf") if self.kind == "inf" else output.loss * float("nan")
        return output


# ---------------------------------------------------------------------------------------------------- data


def _feature(generator: torch.Generator, length: int) -> dict[str, Any]:
    """Random tokens below TRIGGER; the first half is the prompt (so position 0 may be edited freely)."""
    ids = torch.randint(0, TRIGGER, (length,), generator=generator).tolist()
    prompt = length // 2
    return make_input_feature(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


_generator = torch.Generator().manual_seed(1)
X = [_feature(_generator, n) for n in (9, 12, 10)]
Y = [_feature(_generator, n) for n in (11, 8)]
BAD = [_feature(_generator, n) for n in (10, 7, 12, 9)]
BAD_ADVANTAGES = [0.5, -1.0, 1.5, -0.3]
# Row 3 holds the trigger: with micro_batch_size splitting BAD in two, only the second half fails.
BAD_TRIGGERED = [*BAD[:3], {**BAD[3], "input_ids": [TRIGGER, *BAD[3]["input_ids"][1:]]}]
BAD_TRIGGERED_FIRST = [{**BAD[0], "input_ids": [TRIGGER, *BAD[0]["input_ids"][1:]]}, *BAD[1:]]
BAD_OUT_OF_VOCAB = [BAD[0], {**BAD[1], "input_ids": [VOCAB_SIZE, *BAD[1]["input_ids"][1:]]}, *BAD[2:]]
PREP = [  # (x, y, bad) batches of the three preparation calls
    tuple([_feature(_generator, n) for n in lengths] for lengths in ((8, 9, 10), (9, 10), (8, 11, 9, 10)))
    for _ in range(3)
]


def _y_loss_inputs(model: MultiLoraModel, features: list[dict]) -> dict[str, Any]:
    """Advantages and a sampler's log-probs of the trained tokens (the current policy's, perturbed)."""
    logps = model.forward_only(features, adapter_name="y").logps
    generator = torch.Generator().manual_seed(len(features))
    old = []
    for lp, feature in zip(logps, features, strict=True):
        trained = lp[torch.tensor(feature["loss_mask"]) == 1]
        old.append((trained + 0.1 * torch.randn(trained.shape, generator=generator)).tolist())
    return {"advantages": [1.0, -0.5][: len(features)] + [0.25] * (len(features) - 2), "old_logps": old}


# ---------------------------------------------------------------------------------------------------- model


def _prepared_model(kind: str = "nan") -> tuple[MultiLoraModel, dict[str, Any]]:
    """The three adapters after two shared steps; ``bad`` has stepped once and holds accumulated gradients.

    Deterministic: two calls give bit-identical models. Returns the model and ``y``'s loss inputs for Y.
    """
    torch.manual_seed(0)
    model = MultiLoraModel(device="cpu", max_loras=3, max_rank=8)
    model.add_adapter_to_model("x", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.add_adapter_to_model("y", LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.add_adapter_to_model(
        "bad", LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj", "down_proj"]), 2
    )
    for index, name in enumerate(("x", "y", "bad")):
        generator = torch.Generator().manual_seed(10 + index)
        with torch.no_grad():
            for key, tensor in model.lora_payload(name)[1].items():
                if ".lora_B." in key:
                    tensor.normal_(0, 0.05, generator=generator)
    model.set_optimizer("AdamW", adapter_name="x", lr=1e-2)
    model.set_optimizer("SGD", adapter_name="y", lr=0.1, momentum=0.9)
    model.set_optimizer("AdamW", adapter_name="bad", lr=1e-2, weight_decay=0.1)
    model.set_lr_scheduler("CosineWarmupScheduler", adapter_name="bad", num_warmup_steps=1, num_training_steps=10)
    model.set_loss("GRPOLoss", adapter_name="y")
    model.set_loss(FailingLoss(kind), adapter_name="bad")
    for step, (x, y, bad) in enumerate(PREP):
        requests = [AdapterRequest("bad", bad, {"advantages": BAD_ADVANTAGES})]
        if step < 2:
            requests = [AdapterRequest("x", x), AdapterRequest("y", y, _y_loss_inputs(model, y)), *requests]
        results = model.forward_backward_many(requests)
        assert all(r.ok for r in results), [r.error for r in results]
        if step < 2:
            for name in ("x", "y", "bad"):
                model.clip_grad_and_step(1.0, adapter_name=name)
    bad = model.train_state("bad")
    assert bad.global_step == 1 and bad.accumulated == 1 and bad.optimizer.state  # stepped once, accumulating
    assert all(t.grad is not None for t in model.lora_payload("bad")[1].values())
    assert all(t.grad is None for name in ("x", "y") for t in model.lora_payload(name)[1].values())
    return model, _y_loss_inputs(model, Y)


def _grads(model: MultiLoraModel, name: str) -> dict[str, torch.Tensor | None]:
    return {k: None if t.grad is None else t.grad.clone() for k, t in model.lora_payload(name)[1].items()}


def _snapshot(model: MultiLoraModel, name: str) -> dict[str, Any]:
    state = model.train_state(name)
    return {
        "weights": {k: t.detach().clone() for k, t in model.lora_payload(name)[1].items()},
        "grads": _grads(model, name),
        "optimizer": copy.deepcopy(state.optimizer.state_dict()),
        "lr_scheduler": copy.deepcopy(state.lr_scheduler.state_dict()) if state.lr_scheduler else None,
        "counters": state.counters(),
    }


def _components(model: MultiLoraModel, name: str) -> list[Any]:
    state = model.train_state(name)
    return [state.optimizer, state.lr_scheduler, state.loss, state.processor, state.template, *state.params]


def _assert_equal(before: Any, after: Any, where: str) -> None:
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


def _healthy_bad_step(model: MultiLoraModel) -> dict[str, torch.Tensor]:
    """``bad``'s next healthy call completes its accumulation; its weights after that step."""
    (result,) = model.forward_backward_many([AdapterRequest("bad", BAD, {"advantages": BAD_ADVANTAGES})])
    assert result.ok, result.error
    assert model.clip_grad_and_step(1.0, adapter_name="bad")["stepped"] is True
    return {k: t.detach().clone() for k, t in model.lora_payload("bad")[1].items()}


# ---------------------------------------------------------------------------------------------------- baseline


@pytest.fixture(scope="module")
def baseline():
    """``baseline(micro_batch_size)``: the same call without the failing request, and ``bad``'s next step."""
    cache: dict[int | None, dict[str, Any]] = {}

    def get(micro_batch_size: int | None) -> dict[str, Any]:
        if micro_batch_size not in cache:
            model, y_inputs = _prepared_model()
            before = _snapshot(model, "bad")
            results = model.forward_backward_many(
                [AdapterRequest("x", X), AdapterRequest("y", Y, y_inputs)], micro_batch_size=micro_batch_size
            )
            assert all(r.ok for r in results), [r.error for r in results]
            cache[micro_batch_size] = {
                "bad_before": before,
                "outputs": {r.adapter_name: r.output for r in results},
                "grads": {name: _grads(model, name) for name in ("x", "y")},
                "bad_next_step": _healthy_bad_step(model),
            }
        return cache[micro_batch_size]

    return get


# ---------------------------------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    requests: Callable[[dict[str, Any]], list[Any]]  # given y's loss inputs
    failing: int  # index of the failing request
    error: type[Exception]
    message: str  # regular expression the error's text must match
    kind: str = "nan"  # what FailingLoss does when triggered
    micro_batch_size: int | None = None


def _x(y_inputs):
    return AdapterRequest("x", X)


def _y(y_inputs):
    return AdapterRequest("y", Y, y_inputs)


def _bad(features=BAD, **loss_inputs):
    return AdapterRequest("bad", features, {"advantages": BAD_ADVANTAGES, **loss_inputs})


SCENARIOS = {
    "nan_loss": Scenario(
        lambda y: [_x(y), _bad(BAD_TRIGGERED), _y(y)], 1, InvalidInputError, r"FailingLoss is not finite \(nan\)"
    ),
    "inf_loss": Scenario(
        lambda y: [_x(y), _bad(BAD_TRIGGERED), _y(y)], 1, InvalidInputError, r"not finite \(inf\)", kind="inf"
    ),
    "loss_raises": Scenario(
        lambda y: [_x(y), _bad(BAD_TRIGGERED), _y(y)], 1, RuntimeError, "tenant loss exploded", kind="raise"
    ),
    "id_outside_the_vocabulary": Scenario(
        lambda y: [_x(y), _bad(BAD_OUT_OF_VOCAB), _y(y)],
        1,
        InvalidInputError,
        r"inputs\[1\]\.input_ids contains ids outside the vocabulary \[0, 151936\): \[151936\]",
    ),
    "advantages_of_the_wrong_length": Scenario(
        lambda y: [_x(y), AdapterRequest("bad", BAD, {"advantages": BAD_ADVANTAGES[:3]}), _y(y)],
        1,
        InvalidInputError,
        "'advantages' has 3 entries but the batch has 4 samples",
    ),
    "per_token_advantages_of_the_wrong_length": Scenario(  # found by the loss, after the forward
        lambda y: [_x(y), AdapterRequest("bad", BAD, {"advantages": [[1.0, 2.0]] * 4}), _y(y)],
        1,
        InvalidInputError,
        r"advantages\[0\] has 2 values, but sample 0 has 5 supervised tokens",
    ),
    "old_logps_holding_nan": Scenario(  # found by the loss, after the forward
        lambda y: [_x(y), _y(y), _bad(old_logps=[-1.0, float("nan"), -2.0, -3.0])],
        2,
        InvalidInputError,
        r"old_logps\[1\] holds nan",
    ),
    "unknown_adapter": Scenario(
        lambda y: [_x(y), AdapterRequest("nobody", X), _y(y)], 1, ConfigurationError, "unknown adapter 'nobody'"
    ),
    "adapter_named_twice": Scenario(  # the first request of x trains; the second is refused
        lambda y: [_x(y), _y(y), AdapterRequest("x", X[:1])], 2, InvalidInputError, "more than one request"
    ),
    "malformed_request": Scenario(
        lambda y: [_x(y), {"adapter_name": "bad", "loss_inputs": {}}, _y(y)], 1, TypeError, "inputs"
    ),
    # BAD's rows split over two micro-batches; the loss is NaN only in the second, after the first's backward.
    "nan_in_the_second_micro_batch": Scenario(
        lambda y: [_bad(BAD_TRIGGERED), _x(y), _y(y)],
        0,
        InvalidInputError,
        r"not finite \(nan\)",
        micro_batch_size=2,
    ),
    # The first micro-batch fails: BAD's later rows are not run at all.
    "nan_in_the_first_micro_batch": Scenario(
        lambda y: [_bad(BAD_TRIGGERED_FIRST), _x(y), _y(y)],
        0,
        InvalidInputError,
        r"not finite \(nan\)",
        micro_batch_size=2,
    ),
    # Micro-batches [x x x bad] [bad bad bad* y] [y]: the failing one also carries y's first row.
    "nan_in_a_micro_batch_shared_with_another_adapter": Scenario(
        lambda y: [_x(y), _bad(BAD_TRIGGERED), _y(y)],
        1,
        InvalidInputError,
        r"not finite \(nan\)",
        micro_batch_size=4,
    ),
    "raise_in_the_second_micro_batch": Scenario(
        lambda y: [_x(y), _bad(BAD_TRIGGERED), _y(y)],
        1,
        RuntimeError,
        "tenant loss exploded",
        kind="raise",
        micro_batch_size=3,
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_failing_request_spoils_nothing(name, baseline):
    scenario = SCENARIOS[name]
    expected = baseline(scenario.micro_batch_size)
    model, y_inputs = _prepared_model(scenario.kind)
    model.calculate_metric(adapter_name="bad")  # start from empty metrics
    before, components = _snapshot(model, "bad"), _components(model, "bad")
    _assert_equal(expected["bad_before"], before, "two prepared models")  # so the baseline is this model's
    requests = scenario.requests(y_inputs)

    results = model.forward_backward_many(requests, micro_batch_size=scenario.micro_batch_size)

    # (a) the failing request, and only it, reports its cause
    assert len(results) == len(requests)
    failed = results[scenario.failing]
    assert not failed.ok and failed.output is None
    assert isinstance(failed.error, scenario.error), repr(failed.error)
    assert re.search(scenario.message, str(failed.error)), str(failed.error)
    request = requests[scenario.failing]
    want_name = request["adapter_name"] if isinstance(request, dict) else request.adapter_name
    assert failed.adapter_name == want_name
    assert [r.ok for i, r in enumerate(results) if i != scenario.failing] == [True] * (len(results) - 1)

    # (b) bad is exactly as it was, and its next step is that of a model that never saw the failure
    _assert_equal(before, _snapshot(model, "bad"), "bad")
    assert all(old is new for old, new in zip(components, _components(model, "bad"), strict=True))
    assert set(model.calculate_metric(adapter_name="bad")) <= {"lr", "global_step"}
    bad_next_step = _healthy_bad_step(model)
    _assert_equal(expected["bad_next_step"], bad_next_step, "bad after its next step")

    # (c) x and y got what the same call without the failing request gives them
    outputs = {r.adapter_name: r.output for i, r in enumerate(results) if i != scenario.failing}
    for adapter in ("x", "y"):
        ours, reference = outputs[adapter], expected["outputs"][adapter]
        assert ours.loss == pytest.approx(reference.loss, rel=1e-6, abs=1e-6)
        assert ours.num_tokens == reference.num_tokens
        for mine, theirs in zip(ours.logps, reference.logps, strict=True):
            torch.testing.assert_close(mine, theirs, **CLOSE)
        grads = _grads(model, adapter)
        for key, grad in expected["grads"][adapter].items():
            assert grad is not None and grads[key] is not None, key
            torch.testing.assert_close(grads[key], grad, **CLOSE, msg=lambda m, a=adapter, k=key: f"{a} {k}: {m}")
        assert model.train_state(adapter).accumulated == 1


def test_failures_of_every_kind_in_one_call(baseline):
    """Several failing requests at once: the healthy ones still get exactly their own step."""
    expected = baseline(None)
    model, y_inputs = _prepared_model("nan")
    before = _snapshot(model, "bad")
    requests = [
        AdapterRequest("nobody", X),
        _x(y_inputs),
        _bad(BAD_TRIGGERED),
        AdapterRequest("x", X),
        _y(y_inputs),
    ]
    results = model.forward_backward_many(requests)
    assert [r.ok for r in results] == [False, True, False, False, True]
    _assert_equal(before, _snapshot(model, "bad"), "bad")
    for adapter in ("x", "y"):
        for key, grad in expected["grads"][adapter].items():
            torch.testing.assert_close(_grads(model, adapter)[key], grad, **CLOSE)


def test_every_request_failing_changes_nothing():
    model, _ = _prepared_model("nan")
    snapshots = {name: _snapshot(model, name) for name in ("x", "y", "bad")}
    results = model.forward_backward_many([_bad(BAD_TRIGGERED), AdapterRequest("nobody", X)], micro_batch_size=2)
    assert [r.ok for r in results] == [False, False]
    for name, snapshot in snapshots.items():
        _assert_equal(snapshot, _snapshot(model, name), name)
