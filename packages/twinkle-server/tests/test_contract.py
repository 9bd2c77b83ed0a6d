"""The native bodies' models: each method's arguments, what the server decides, errors naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.errors import InvalidInputError
from twinkle.server.app.schemas.calls import ARGUMENTS, CallRequest
from twinkle.server.app.schemas.runs import CreateRun
from twinkle.server.contract import validate
from twinkle.server.services.pool import SHORT_METHODS

LIMITS = {"vocab_size": 100, "max_length": 8}


def _call(body):
    return validate(CallRequest, body, LIMITS)


def test_a_call_becomes_its_methods_arguments():
    call = _call({"method": "forward_backward", "kwargs": {"inputs": [{"input_ids": [1, 2]}], "advantages": [0.5]}})
    assert call.method == "forward_backward" and call.idempotency_key is None
    assert call.arguments() == {"inputs": [{"input_ids": [1, 2]}], "micro_batch_size": None, "advantages": [0.5]}
    wire_arrays = {"inputs": {"input_ids": np.arange(3)}, "old_logps": np.zeros(1, np.float32)}
    assert _call({"method": "forward_only", "kwargs": wire_arrays}).arguments()["return_logits"] is False
    assert set(SHORT_METHODS) < set(ARGUMENTS)


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"method": "__init__"}, None, "unknown method '__init__'"),
        ({"method": {}}, None, "unknown method"),
        ({"method": "save", "kwargs": {"name": "../up"}}, "kwargs.name", "path separator"),
        ({"method": "save", "kwargs": {"name": "sampler_weights"}}, "kwargs", "reserved"),
        ({"method": "save", "kwargs": {"name": "a", "output_dir": "/tmp"}}, "kwargs.output_dir", "Extra inputs"),
        ({"method": "set_loss", "kwargs": {"loss": "os:system"}}, "kwargs.loss", "registered name"),
        ({"method": "set_optimizer", "kwargs": {"adapter_name": "bob"}}, "kwargs", "cannot be set remotely"),
        ({"method": "forward", "kwargs": {"inputs": [{"input_ids": [100]}]}}, "kwargs.inputs", "vocabulary"),
        ({"method": "forward", "kwargs": {"inputs": [{"input_ids": [1] * 9}]}}, "kwargs.inputs", "context is 8"),
        ({"method": "forward", "kwargs": {"inputs": []}}, "kwargs.inputs", "non-empty list"),
        ({"method": "forward", "kwargs": {"inputs": [{"messages": []}]}}, "kwargs.inputs", "non-empty list"),
        (
            {"method": "forward_backward", "kwargs": {"inputs": [{"input_ids": [1]}], "advantages": [1.0, 2.0]}},
            "kwargs",
            "has 2 entries but the batch has 1",
        ),
        ({"method": "forward", "kwargs": {"inputs": {"input_ids": [1]}, "beta": 1}}, "kwargs.beta", "Extra inputs"),
        ({"method": "forward_only", "kwargs": {"inputs": {"input_ids": [1]}, "beta": "x"}}, "kwargs.beta", "number"),
        ({"method": "clip_grad_norm", "kwargs": {"max_grad_norm": 0}}, "kwargs.max_grad_norm", "greater than 0"),
        ({"method": "step", "kwargs": {"lr": 1}}, "kwargs.lr", "Extra inputs"),
        ({"method": "save", "kwargs": {"name": "a", "ttl_seconds": -1}}, "kwargs.ttl_seconds", "ttl_seconds must be"),
    ],
)
def test_bad_calls_name_the_field(body, field, message):
    with pytest.raises(InvalidInputError, match=message) as caught:
        _call(body)
    assert caught.value.field == field


def test_run_bodies_refuse_unknown_fields_and_keep_lora_arguments_as_sent():
    run = validate(CreateRun, {"session_id": "s", "lora_config": {"r": 4, "use_rslora": True}})
    assert run.lora_dict() == {"r": 4, "use_rslora": True}
    with pytest.raises(InvalidInputError, match="sedd") as caught:
        validate(CreateRun, {"session_id": "s", "sedd": 1})
    assert caught.value.field == "sedd"


def test_routing_records_are_checked_against_the_served_models_routing():
    feature = {"input_ids": [1, 2], "routed_experts": [[[0, 1]] * 4, [[-1, -1]] * 4]}
    body = {"method": "forward_backward", "kwargs": {"inputs": [feature]}}
    assert validate(CallRequest, body, {**LIMITS, "routing": (4, 2, 8)}).arguments()["inputs"] == [feature]
    refusals = {
        None: "inputs\\[0\\].routed_experts was given, but the server's model has no MoE router to replay it on",
        (4, 1, 8): "records 4 layer\\(s\\) x top-2; the server's model has 4 MoE layer\\(s\\) x top-1",
        (4, 2, 1): "holds expert id 1; the server's model has 1 experts",
    }
    for routing, message in refusals.items():
        with pytest.raises(InvalidInputError, match=message):
            validate(CallRequest, body, {**LIMITS, "routing": routing})
