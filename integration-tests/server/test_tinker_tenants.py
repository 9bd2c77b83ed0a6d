"""Several Tinker clients on one server: training together equals training alone, and bad input hurts no one.

Every adapter starts from a fixed LoRA seed, so a client's weights after a few
steps must be the same (float32, 1e-5) whether it trained alone or beside another client
(and beside a client sending garbage); each bad request gets the SDK's own
exception, naming the problem.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from safetensors.torch import load_file
from tinker import types
from transformers import AutoModelForCausalLM

from twinkle.hub import resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from tinker_harness import BASE_MODEL, close_clients, logprobs_of, service_client, sft_datum

pytestmark = pytest.mark.integration

STEPS = 3
PROBE = [sft_datum(999, length=12)]


@pytest.fixture(scope="module")
def server(start_server):
    yield start_server(["alice", "bob", "carol"], max_loras=16, quotas={"max_adapters": 8})
    close_clients()


def train(client: tinker.ServiceClient, seed: int, tag: int) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """``STEPS`` pipelined SFT steps from LoRA seed ``seed``; the probe's log-probs and the saved adapter."""
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=seed).result()
    for step in range(STEPS):
        data = [sft_datum(tag * 100 + step * 2), sft_datum(tag * 100 + step * 2 + 1, length=7)]
        fwdbwd = trainer.forward_backward(data, "cross_entropy")
        optim = trainer.optim_step(types.AdamParams(learning_rate=5e-3, weight_decay=0.01, grad_clip_norm=1.0))
        fwdbwd.result(), optim.result()
    probe = logprobs_of(trainer.forward(PROBE, "cross_entropy").result())[0]
    path = trainer.save_state(f"after-{tag}").result().path
    return probe, _adapter_tensors(client, path)


def _adapter_tensors(client: tinker.ServiceClient, path: str) -> dict[str, torch.Tensor]:
    return load_file(str(_checkpoint_folder(client, path) / "adapter_model.safetensors"))


def _checkpoint_folder(client: tinker.ServiceClient, path: str) -> Path:
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
    state_dir = client._test_state_dir  # set by client_for below
    user = client._test_user
    return state_dir / "checkpoints" / user / parsed.training_run_id / parsed.checkpoint_id.split("/", 1)[1]


def client_for(server, user: str) -> tinker.ServiceClient:
    client = service_client(server, user)
    client._test_state_dir, client._test_user = server.state_dir, user
    return client


def assert_same(got: tuple[np.ndarray, dict], want: tuple[np.ndarray, dict]) -> None:
    """Equal up to float32 reassociation: calls in one shared pass are padded to, and multiplied as, one batch."""
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-5, atol=1e-5, msg=name)


def test_two_clients_training_at_once_get_the_adapters_they_get_alone(server):
    alice, bob = client_for(server, "alice"), client_for(server, "bob")
    alone = {"alice": train(alice, seed=11, tag=1), "bob": train(bob, seed=12, tag=2)}
    with ThreadPoolExecutor(2) as pool:
        together = {
            "alice": pool.submit(train, alice, 11, 1),
            "bob": pool.submit(train, bob, 12, 2),
        }
        together = {user: future.result() for user, future in together.items()}
    for user in ("alice", "bob"):
        assert_same(together[user], alone[user])
    assert not np.array_equal(alone["alice"][0], alone["bob"][0])  # different data and seeds: different adapters


def test_forward_backward_custom_gets_the_cross_entropy_gradient(server):
    client = client_for(server, "carol")
    data = [sft_datum(7), sft_datum(8, length=6)]
    results = []
    for custom in (False, True):
        trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result()
        if custom:

            def nll(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
                weights = [torch.tensor(d.loss_fn_inputs["weights"].to_numpy()) for d in data]
                loss = -sum((lp * w).sum() for lp, w in zip(logprobs, weights, strict=True))
                return loss, {"custom_nll:sum": float(loss.detach())}

            output = trainer.forward_backward_custom(data, nll).result()
        else:
            output = trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        results.append((output.metrics["loss:sum"], logprobs_of(trainer.forward(PROBE, "cross_entropy").result())[0]))
    (ce_loss, ce_probe), (custom_loss, custom_probe) = results
    assert custom_loss == pytest.approx(ce_loss, rel=1e-5)
    np.testing.assert_allclose(custom_probe, ce_probe, atol=1e-5)


def _bad_requests(trainer: tinker.TrainingClient, client: tinker.ServiceClient, others_path: str) -> list[str]:
    """Send every kind of bad input; returns the error messages (each must be the SDK's exception)."""
    good = sft_datum(1)
    tokens = good.model_input.to_ints()
    float_targets = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={"target_tokens": np.asarray(tokens, dtype=np.float32), "weights": [1.0] * len(tokens)},
    )
    short_weights = types.Datum(
        model_input=good.model_input, loss_fn_inputs={"target_tokens": tokens, "weights": [1.0] * (len(tokens) - 2)}
    )
    out_of_vocab = types.Datum(
        model_input=types.ModelInput.from_ints([10**7, 1, 2]),
        loss_fn_inputs={"target_tokens": [1, 2, 3], "weights": [1.0, 1.0, 1.0]},
    )
    nan_advantages = types.Datum(
        model_input=good.model_input,
        loss_fn_inputs={"target_tokens": tokens, "logprobs": [0.0] * len(tokens), "advantages": [float("nan")] * 10},
    )
    cases = [
        (tinker.BadRequestError, lambda: trainer.forward_backward([float_targets], "cross_entropy").result()),
        (tinker.BadRequestError, lambda: trainer.forward_backward([short_weights], "cross_entropy").result()),
        (tinker.BadRequestError, lambda: trainer.forward_backward([out_of_vocab], "cross_entropy").result()),
        (tinker.BadRequestError, lambda: trainer.forward_backward([nan_advantages], "importance_sampling").result()),
        (tinker.BadRequestError, lambda: trainer.forward_backward([good], "no_such_loss").result()),
        (tinker.BadRequestError, lambda: trainer.forward_backward([good], "ppo", {"clip_low_threshold": 2.0}).result()),
        (tinker.BadRequestError, lambda: trainer.optim_step(types.AdamParams(learning_rate=-1.0)).result()),
        (tinker.NotFoundError, lambda: client.create_training_client_from_state("tinker://nope/weights/x").result()),
        (tinker.NotFoundError, lambda: client.create_sampling_client(model_path=others_path).result()),
    ]
    messages = []
    for error, call in cases:
        with pytest.raises(error) as raised:
            call()
        messages.append(str(raised.value))
    return messages


def test_bad_input_gets_the_sdk_error_and_costs_other_clients_nothing(server):
    alice, bob = client_for(server, "alice"), client_for(server, "bob")
    alone = train(bob, seed=21, tag=3)
    bobs_trainer = bob.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    bobs_path = bobs_trainer.save_weights_for_sampler("bobs").result().path
    sender = alice.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    before = logprobs_of(sender.forward(PROBE, "cross_entropy").result())[0]
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(train, bob, 21, 3)
        messages = pool.submit(_bad_requests, sender, alice, bobs_path).result()
        beside = beside.result()
    assert_same(beside, alone)
    joined = "\n".join(messages)
    for expected in ("target_tokens", "weights", "vocabulary", "advantages", "no_such_loss", "clip", "learning_rate"):
        assert expected in joined, f"no message names {expected!r}:\n{joined}"
    # the refused requests left the sender's adapter as it was, and it trains on
    np.testing.assert_array_equal(logprobs_of(sender.forward(PROBE, "cross_entropy").result())[0], before)
    assert sender.forward_backward([sft_datum(5)], "cross_entropy").result().metrics["loss:sum"] > 0


def _peft_logprobs(model: torch.nn.Module, datum: types.Datum) -> np.ndarray:
    tokens = torch.tensor([datum.model_input.to_ints()])
    targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"].to_numpy()).long()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=tokens).logits[0], -1)
    return logprobs.gather(-1, targets[:, None])[:, 0].numpy()


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # PEFT, on the tied lm_head
def test_train_unembed_trains_the_output_layer_and_the_adapter_loads_in_plain_peft(server):
    """The SDK's default ``train_unembed=True`` puts LoRA on ``lm_head``; plain PEFT gives the server's log-probs.

    The server computes in float32 and the reference in float64: on this model's
    log-probs (|lp| < 20) float32 round-off is ~1e-7 and stays far below 1e-5 on
    any CPU, while the output layer's trained update moves them by > 1e-3.
    """
    client = client_for(server, "carol")
    data = [sft_datum(31), sft_datum(32, length=7)]
    saved = {}
    for train_unembed in (True, False):
        trainer = client.create_lora_training_client(
            base_model=BASE_MODEL, rank=4, seed=3, train_unembed=train_unembed
        ).result()
        for _ in range(2):
            trainer.forward_backward(data, "cross_entropy").result()
            trainer.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        served = logprobs_of(trainer.forward(PROBE, "cross_entropy").result())[0]
        saved[train_unembed] = served, trainer.save_state("unembed").result().path
    served, path = saved[True]
    tensors = _adapter_tensors(client, path)
    assert tensors["base_model.model.lm_head.lora_B.weight"].abs().max() > 0, "training moved the output layer's B"
    assert not [key for key in tensors if "base_layer" in key], "only the adapter is saved, not the frozen base"
    assert not [key for key in _adapter_tensors(client, saved[False][1]) if "lm_head" in key]

    base = AutoModelForCausalLM.from_pretrained(resolve_model(BASE_MODEL), dtype=torch.float64)
    plain = PeftModel.from_pretrained(base, _checkpoint_folder(client, path)).eval()
    np.testing.assert_allclose(served, _peft_logprobs(plain, PROBE[0]), atol=1e-5, rtol=0)
    with torch.no_grad():  # the same adapter without its output-layer update
        plain.get_base_model().lm_head.lora_B["default"].weight.zero_()
    assert np.abs(served - _peft_logprobs(plain, PROBE[0])).max() > 1e-3
