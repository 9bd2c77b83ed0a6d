"""vLLMSampler on vLLM's async engine (``async_engine=True``): concurrent calls share the engine, streaming.

The engine core runs in its own process (``AsyncLLM`` always does); log-probs
still equal the trainer's at 1e-5 in float32.
"""

import threading
import time

import pytest
import torch

from twinkle.data_format import IGNORE_INDEX, SamplingParams

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: `make test-vllm` runs these in .venv-vllm")

ATOL = 1e-5


@pytest.fixture(scope="module")
def trainers(vllm_trainer):
    """The base model, and the model with adapter ``small`` (a model with an adapter trains that adapter)."""
    return {None: vllm_trainer(), "small": vllm_trainer("small")}


@pytest.fixture(scope="module")
def sampler(vllm_model_dir, vllm_template, vllm_engine_args, trainers, lora_of):
    from twinkle.sampler import vLLMSampler

    sampler = vLLMSampler(vllm_model_dir, engine_args=vllm_engine_args, async_engine=True)
    sampler.set_template(vllm_template)
    sampler.add_adapter("small", *lora_of(trainers["small"], "small"))
    yield sampler
    sampler.close()


def trainer_gap(trainers, sequences, adapter):
    features = [s.new_input_feature for s in sequences]
    logps = trainers[adapter].forward_only(inputs=features, adapter_name=adapter).logps
    return max(
        abs(a - b)
        for s, row, f in zip(sequences, logps, features, strict=True)
        for a, b in zip(s.logprobs, row[torch.tensor(f["labels"]) != IGNORE_INDEX].tolist(), strict=True)
    )


def test_concurrent_calls_each_get_the_trainers_logprobs(sampler, trainers, vllm_prompts):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    calls = [(vllm_prompts[i % 3], adapter) for i, adapter in enumerate(["small", None, "small", None])]
    results: list = [None] * len(calls)

    def run(index: int) -> None:
        prompt, adapter = calls[index]
        results[index] = sampler.sample(prompt, params, adapter_name=[adapter], num_samples=2)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (_, adapter), response in zip(calls, results, strict=True):
        gap = trainer_gap(trainers, response.sequences, adapter)
        print(f"concurrent adapter={adapter}: max |dlogp| {gap:.2e}")
        assert gap <= ATOL


def test_a_short_request_finishes_while_a_long_stream_runs(sampler, vllm_prompts):
    """The engine serves requests as they come: a sample sent mid-stream does not wait for the stream's end."""
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    stream = sampler.sample_stream(vllm_prompts[0], long, adapter_name="small")
    first = next(stream)
    sampler.sample(vllm_prompts[1], SamplingParams(max_tokens=2, temperature=0), use_base_model=True)
    returned = time.monotonic()
    rest = list(stream)
    tokens = first.tokens + [token for chunk in rest for token in chunk.tokens]
    assert len(tokens) == 300 and rest[-1].stop_reason == "length"
    assert len(rest) > 1, "the stream still had tokens to generate after the short request returned"
    assert time.monotonic() > returned


def collect(stream):
    """``{(input_index, sample_index): (tokens, logprobs, stop_reason)}`` of a stream, and its chunk count."""
    streamed: dict = {}
    count = 0
    for chunk in stream:
        count += 1
        tokens, logprobs, _ = streamed.get((chunk.input_index, chunk.sample_index), ([], [], None))
        streamed[(chunk.input_index, chunk.sample_index)] = (
            tokens + chunk.tokens,
            logprobs + chunk.logprobs,
            chunk.stop_reason,
        )
    return streamed, count


def test_stream_chunks_add_up_to_what_sample_returns(sampler, vllm_prompts):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    inputs = [vllm_prompts[0], vllm_prompts[1], vllm_prompts[0]]
    adapters = ["small", None, None]
    expected = sampler.sample(inputs, greedy, adapter_name=adapters)
    streamed, count = collect(sampler.sample_stream(inputs, greedy, adapter_name=adapters))
    assert count > len(streamed), "tokens arrive in several chunks, not at the end"
    for sequence in expected.sequences:
        tokens, logprobs, stop_reason = streamed[(sequence.input_index, 0)]
        assert tokens == sequence.tokens and stop_reason == sequence.stop_reason
        assert max(abs(a - b) for a, b in zip(logprobs, sequence.logprobs, strict=True)) <= ATOL
    several, _ = collect(sampler.sample_stream(inputs[:2], SamplingParams(max_tokens=4, seed=1), num_samples=3))
    assert sorted(several) == [(i, k) for i in range(2) for k in range(3)]
