"""The unmodified ``tinker`` SDK (0.38) against a real ``twinkle server`` process: every call it makes in normal use.

One server per module (``tinker_chunk_datums: 2``, so a forward_backward of
five datums arrives as three chunks, the first one last). Each test checks
what a Tinker user relies on: shapes and dtypes, ``tinker://`` paths, the
numbers against ``forward``'s log-probs, and the SDK's own exceptions.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).parent))
from tinker_harness import (
    BASE_MODEL,
    close_clients,
    logprobs_of,
    rest_client,
    rl_datum,
    service_client,
    sft_datum,
    weights_of,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(start_server):
    yield start_server(["alice", "bob"], tinker_chunk_datums=2, max_loras=12, quotas={"max_adapters": 8})
    close_clients()


@pytest.fixture(scope="module")
def alice(server):
    client = service_client(server, "alice")
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def trainer(alice):
    return alice.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=0).result()


def test_capabilities_list_the_base_model(server):
    capabilities = rest_client(server, "alice").get_server_capabilities().result()
    assert [model.model_name for model in capabilities.supported_models] == [BASE_MODEL]


def test_training_client_info_and_tokenizer(trainer):
    info = trainer.get_info()
    assert info.is_lora and info.lora_rank == 8
    assert info.model_id.endswith(":train:0")
    tokenizer = trainer.get_tokenizer()  # loaded offline from the server's local model folder
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


def test_forward_returns_float32_logprobs_and_the_exact_cross_entropy_sum(trainer):
    data = [sft_datum(1), sft_datum(2, length=6)]
    output = trainer.forward(data, "cross_entropy").result()
    logprobs = logprobs_of(output)
    assert [item["logprobs"].dtype for item in output.loss_fn_outputs] == ["float32", "float32"]
    assert [len(lp) for lp in logprobs] == [10, 6]
    assert all((lp < 0).all() for lp in logprobs)
    expected = -sum(float((lp * weights_of(datum)).sum()) for lp, datum in zip(logprobs, data, strict=True))
    assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)


def test_pipelined_forward_backward_and_optim_step_lower_the_loss(alice):
    trainer = alice.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
    data = [sft_datum(10), sft_datum(11)]
    before = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    fwdbwd = trainer.forward_backward(data, "cross_entropy")
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-2))  # sent before the first one finished
    assert fwdbwd.result().metrics["loss:sum"] == pytest.approx(before, rel=1e-5)
    assert step.result().metrics["grad_norm:mean"] > 0
    after = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert after < before


@pytest.mark.parametrize(
    ("loss_fn", "config", "extra"),
    [
        ("importance_sampling", None, {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {}),
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, {}),
        ("dro", {"beta": 0.1}, {}),
        ("gspo", None, {"sequence_ratio_mask": [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]}),
    ],
)
def test_every_rl_loss_trains_and_reports_its_sum(trainer, loss_fn, config, extra):
    sampler_logprobs = [0.0, 0.0, -3.0, -2.5, -4.0, -1.0]
    advantages = [0.0, 0.0, 1.0, 1.0, -0.5, -0.5]
    datum = rl_datum(3, sampler_logprobs, advantages, **extra)
    output = trainer.forward_backward([datum], loss_fn, loss_fn_config=config).result()
    assert np.isfinite(output.metrics["loss:sum"])
    assert len(logprobs_of(output)[0]) == 6
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()  # drop the gradients, keep the weights


def test_importance_sampling_value_matches_forward_logprobs(trainer):
    sampler_logprobs = np.array([0.0, -1.0, -2.0, -3.0], dtype=np.float32)
    advantages = np.array([0.0, 1.0, -1.0, 2.0], dtype=np.float32)
    datum = rl_datum(4, list(sampler_logprobs), list(advantages))
    logprobs = logprobs_of(trainer.forward([sft_datum(4, length=4)], "cross_entropy").result())[0]
    output = trainer.forward([datum], "importance_sampling").result()
    expected = -float((np.exp(logprobs - sampler_logprobs) * advantages).sum())
    assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)


def test_chunked_forward_backward_arrives_out_of_order_and_merges(trainer):
    data = [sft_datum(20 + i, length=4 + i) for i in range(5)]  # three chunks of at most 2 datums
    forward = trainer.forward(data, "cross_entropy").result()
    output = trainer.forward_backward(data, "cross_entropy").result()
    assert [len(lp) for lp in logprobs_of(output)] == [4, 5, 6, 7, 8]
    for got, want in zip(logprobs_of(output), logprobs_of(forward), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert output.metrics["loss:sum"] == pytest.approx(forward.metrics["loss:sum"], rel=1e-5)
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()


def test_saves_return_tinker_paths_listed_by_the_rest_client(server, trainer):
    state_path = trainer.save_state("ckpt-1").result().path
    sampler_path = trainer.save_weights_for_sampler("samp-1").result().path
    run_id = trainer.get_info().model_id
    assert state_path == f"tinker://{run_id}/weights/ckpt-1"
    assert sampler_path == f"tinker://{run_id}/sampler_weights/samp-1"
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(state_path)
    assert (parsed.training_run_id, parsed.checkpoint_type) == (run_id, "training")
    rest = rest_client(server, "alice")
    listed = rest.list_checkpoints(run_id).result().checkpoints
    assert {(c.checkpoint_id, c.checkpoint_type) for c in listed} >= {
        ("weights/ckpt-1", "training"),
        ("sampler_weights/samp-1", "sampler"),
    }
    run = rest.get_training_run_by_tinker_path(state_path).result()
    assert (run.training_run_id, run.is_lora, run.lora_rank) == (run_id, True, 8)
    assert rest.get_training_run(run_id).result().last_checkpoint.checkpoint_id == "weights/ckpt-1"


def test_sampling_from_a_snapshot_a_saved_path_and_the_base_model(alice, trainer):
    prompt = types.ModelInput.from_ints([151644, 872, 198, 9707])
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)
    snapshot = trainer.save_weights_and_get_sampling_client().result()
    result = snapshot.sample(prompt, num_samples=2, sampling_params=params).result()
    assert len(result.sequences) == 2
    for sequence in result.sequences:
        assert 1 <= len(sequence.tokens) <= 5
        assert len(sequence.logprobs) == len(sequence.tokens)
        assert sequence.stop_reason in ("stop", "length")
        assert sequence.sequence_id
    path = trainer.save_weights_for_sampler("samp-2").result().path
    from_path = alice.create_sampling_client(model_path=path).result()
    assert from_path.get_base_model() == BASE_MODEL
    again = from_path.sample(prompt, num_samples=2, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]  # same weights, same seed
    base = alice.create_sampling_client(base_model=BASE_MODEL).result()
    assert len(base.sample(prompt, num_samples=1, sampling_params=params).result().sequences) == 1


def test_concurrent_sample_requests_are_generated_together_each_as_if_alone(server, alice, trainer):
    """Sample requests in flight at once (a snapshot's and the base model's, other prompts, seeds and lengths)
    queue while a forward runs and are then generated in one batch (``/metrics``). Each gets what it gets sent
    alone: greedy requests the same tokens; seeded ones at temperature 1 log-probs that are its own weights'
    for the tokens it got (the tokens themselves may differ: over this random model's nearly flat distribution
    one float32 rounding of the batch moves an inverse-CDF draw to a neighbouring token id)."""
    trainer.forward_backward([sft_datum(seed) for seed in range(4)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()  # the snapshot's adapter is not the base
    snapshot = trainer.save_weights_and_get_sampling_client().result()
    base = alice.create_sampling_client(base_model=BASE_MODEL).result()
    probe = types.ModelInput.from_ints([151644, 872, 198, 9707, 11, 1879])
    adapted, plain = (client.compute_logprobs(probe).result()[1:] for client in (snapshot, base))
    assert max(abs(a - b) for a, b in zip(adapted, plain, strict=True)) > 1e-2  # a mixed-up row would show
    requests = [
        (
            client,
            [151644, 872, 198, 9707 + index],
            1 + index % 2,
            types.SamplingParams(max_tokens=3 + index, temperature=1.0 if index % 3 == 0 else 0.0, seed=index),
        )
        for index, client in enumerate([snapshot, base] * 4)
    ]
    before = _sample_batches(server)
    forward = trainer.forward([sft_datum(seed) for seed in range(8)], "cross_entropy")  # keeps the model busy
    futures = [client.sample(types.ModelInput.from_ints(ids), n, params) for client, ids, n, params in requests]
    together = [future.result() for future in futures]
    forward.result()
    batches, calls = (after - first for after, first in zip(_sample_batches(server), before, strict=True))
    assert calls == len(requests) and batches < calls, (batches, calls)
    for (client, ids, count, params), result in zip(requests, together, strict=True):
        assert len(result.sequences) == count
        if params.temperature == 0.0:
            alone = client.sample(types.ModelInput.from_ints(ids), count, params).result()
            assert [s.tokens for s in result.sequences] == [s.tokens for s in alone.sequences]
        for sequence in result.sequences:
            scored = client.compute_logprobs(types.ModelInput.from_ints(ids + sequence.tokens)).result()
            assert sequence.logprobs == pytest.approx(scored[len(ids) :], abs=1e-4)


def _sample_batches(server) -> tuple[float, float]:
    """How many sample batches the server ran so far, and how many sample calls they held."""
    return server.metric("twinkle_sample_batch_requests_count"), server.metric("twinkle_sample_batch_requests_sum")


def test_compute_logprobs_equals_training_forward(alice, trainer):
    tokens = [151644, 872, 198, 9707, 11, 1879, 0]
    path = trainer.save_weights_for_sampler("samp-logprobs").result().path
    sampler = alice.create_sampling_client(model_path=path).result()
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert logprobs[0] is None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    trained = logprobs_of(trainer.forward([datum], "cross_entropy").result())[0]
    np.testing.assert_allclose(np.array(logprobs[1:], dtype=np.float64), trained, atol=1e-5)


def test_async_api(server):
    async def run() -> int:
        client = service_client(server, "bob")
        trainer = await client.create_lora_training_client(base_model=BASE_MODEL, rank=4)
        output = await trainer.forward_backward([sft_datum(30)], "cross_entropy")
        sampler = await client.create_sampling_client(base_model=BASE_MODEL)
        params = types.SamplingParams(max_tokens=3, temperature=0.0)
        sampled = await sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params)
        await client.close("success")
        assert output.metrics["loss:sum"] > 0
        return len(sampled.sequences)

    assert asyncio.run(run()) == 1


def test_create_from_state_with_optimizer_resumes_training(alice):
    trainer = alice.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=2).result()
    data = [sft_datum(40)]
    trainer.forward_backward(data, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("resume").result().path
    resumed = alice.create_training_client_from_state_with_optimizer(path).result()
    assert ":train:" in resumed.get_info().model_id
    original = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(original, rel=1e-6)
    for client in (trainer, resumed):  # the same step from the same state (incl. Adam moments) gives the same loss
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (trainer, resumed)]
    assert after[0] == pytest.approx(after[1], rel=1e-5)


def test_rest_client_deletes_a_checkpoint(server, trainer):
    path = trainer.save_state("to-delete").result().path
    rest = rest_client(server, "alice")
    rest.delete_checkpoint_from_tinker_path(path).result()
    ids = [c.checkpoint_id for c in rest.list_checkpoints(trainer.get_info().model_id).result().checkpoints]
    assert "weights/to-delete" not in ids
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(path).result()


def test_errors_surface_as_the_sdk_exceptions(server, alice, trainer):
    rest = rest_client(server, "alice")
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("no-such-run").result()
    with pytest.raises(tinker.BadRequestError, match="unknown loss"):
        trainer.forward_backward([sft_datum(50)], "not_a_loss").result()
    with pytest.raises(tinker.BadRequestError, match="unknown base model"):
        alice.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
    # another user's sampler path is not found, as if it did not exist
    path = trainer.save_weights_for_sampler("private").result().path
    with pytest.raises(tinker.NotFoundError):
        service_client(server, "bob").create_sampling_client(model_path=path).result()
    # the server keeps serving: the same client trains on
    assert trainer.forward([sft_datum(51)], "cross_entropy").result().metrics["loss:sum"] > 0


def test_close_finishes_the_session(server):
    client = service_client(server, "bob")
    trainer = client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    model_id = trainer.get_info().model_id
    client.close("success").result()
    run = rest_client(server, "bob").get_training_run(model_id).result()
    assert run.training_run_id == model_id  # the run and its checkpoints outlive the session


def test_sampling_params_stops_and_top_k_logprobs(alice, trainer):
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([151644, 872, 198, 9707, 11])
    # stop=[] turns off every stop, end-of-sequence included: exactly max_tokens tokens
    free = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, stop=[], seed=1)).result()
    assert [(len(s.tokens), s.stop_reason) for s in free.sequences] == [(6, "length")] * 2
    # a stop token ends the sequence on it
    first = free.sequences[0].tokens
    stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, stop=[first[0]], seed=1)).result()
    assert stopped.sequences[0].tokens == first[:1] and stopped.sequences[0].stop_reason == "stop"
    # greedy with top-k sample and prompt log-probs, scored on the prompt's last 2 positions only
    scored = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=3, temperature=0.0, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        topk_sample_logprobs=3,
        prompt_logprobs_last_n=2,
    ).result()
    sequence = scored.sequences[0]
    topk = sequence.topk_logprobs
    assert [len(row) for row in topk] == [3, 3, 3]
    assert [row[0][0] for row in topk] == sequence.tokens  # greedy: the sampled token is the most likely one
    assert topk[0][0][1] == pytest.approx(sequence.logprobs[0], abs=1e-5)
    assert scored.prompt_logprobs[:3] == [None, None, None] and all(lp < 0 for lp in scored.prompt_logprobs[3:])
    assert [len(row) for row in scored.topk_prompt_logprobs[3:]] == [2, 2]


def test_weights_info_and_the_legacy_load_state(server, alice, trainer):
    path = trainer.save_state("legacy").result().path
    info = rest_client(server, "alice").get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (BASE_MODEL, True, 8)
    fresh = alice.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=9).result()
    with pytest.warns(FutureWarning, match="load_state"):  # the deprecated in-place form, as a first request
        fresh.load_state(path).result()
    data = [sft_datum(60)]
    expected = trainer.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert fresh.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-6)
    weights_only = alice.create_training_client_from_state(path).result()
    assert weights_only.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(expected, rel=1e-6)
