"""``Sampler.sample_many``: several calls in one batch, each getting exactly what ``sample`` gives it alone.

The calls differ in everything a call can set (adapter or base model, greedy or seeded sampling with top-k /
top-p / temperature, repetition penalty, num_samples, max_tokens, stop strings, sampled and prompt log-probs
with top-k alternatives). The sampler runs in float64, so the batch's other rows (other padding, another
batch size) move the logits by round-off far below what could change a token or a float32 log-prob on any
CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from twinkle.data_format import SamplingParams
from twinkle.errors import InvalidInputError
from twinkle.sampler import SampleCall, TorchSampler

TOL = 1e-6  # float32 log-probs of float64 logits: one float32 rounding at most


@pytest.fixture(scope="module")
def sampler(template, trained_model, lora_of):
    sampler = TorchSampler(device="cpu", dtype=torch.float64)
    sampler.set_template(template)
    tenants = trained_model("small", "large")  # ranks 4 and 8
    for name in ("small", "large"):
        sampler.add_adapter(name, *lora_of(tenants, name))
    return sampler


def _calls(prompts: list[dict[str, Any]]) -> list[SampleCall]:
    return [
        SampleCall(prompts[:2], SamplingParams(max_tokens=6, temperature=0), use_base_model=True),
        SampleCall(
            prompts[2],
            SamplingParams(max_tokens=9, temperature=1.0, top_k=20, seed=3, num_samples=3, logprobs=2),
            adapter_name="small",
        ),
        SampleCall(
            [prompts[0], prompts[3]],
            SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=5, prompt_logprobs=2, stop=[" the"]),
            adapter_name="large",
        ),
        # the first call's first prompt again, with other parameters: prefilled and sampled as its own
        SampleCall(prompts[0], SamplingParams(max_tokens=4, repetition_penalty=1.3, seed=7), use_base_model=True),
    ]


def _alone(sampler: TorchSampler, call: SampleCall) -> Any:
    return sampler.sample(call.inputs, call.sampling_params, call.adapter_name, call.num_samples, call.use_base_model)


def _assert_same(together: Any, alone: Any) -> None:
    assert [s.tokens for s in together.sequences] == [s.tokens for s in alone.sequences]
    assert [s.stop_reason for s in together.sequences] == [s.stop_reason for s in alone.sequences]
    assert [s.adapter_name for s in together.sequences] == [s.adapter_name for s in alone.sequences]
    for ours, theirs in zip(together.sequences, alone.sequences, strict=True):
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=TOL)
        for ours_k, theirs_k in zip(ours.topk_logprobs or [], theirs.topk_logprobs or [], strict=True):
            assert [token for token, _ in ours_k] == [token for token, _ in theirs_k]
            assert [value for _, value in ours_k] == pytest.approx([value for _, value in theirs_k], abs=TOL)
    if alone.prompt_logprobs is None:
        assert together.prompt_logprobs is None
        return
    for ours_row, theirs_row in zip(together.prompt_logprobs, alone.prompt_logprobs, strict=True):
        assert ours_row[0] is None and theirs_row[0] is None
        assert ours_row[1:] == pytest.approx(theirs_row[1:], abs=TOL)


def test_each_call_of_a_batch_gets_what_it_gets_alone(sampler, prompts):
    calls = _calls(prompts)
    results = sampler.sample_many(calls)
    for call, result in zip(calls, results, strict=True):
        _assert_same(result.unwrap(), _alone(sampler, call))
    sampled = [s.tokens for s in results[1].unwrap().sequences]
    assert len({tuple(tokens) for tokens in sampled}) > 1, "the seeded samples differ from each other"
    assert results[2].unwrap().topk_prompt_logprobs is not None


def test_the_batch_decodes_its_calls_together(sampler, prompts):
    """One prefill and one step per token of the longest call, instead of one decode loop per call."""
    calls = _calls(prompts)
    forwards: list[int] = []
    handle = sampler.model.get_decoder().register_forward_hook(lambda *_: forwards.append(1))
    try:
        sampler.sample_many(calls)
        together = len(forwards)
        forwards.clear()
        for call in calls:
            _alone(sampler, call)
        alone = len(forwards)
    finally:
        handle.remove()
    longest = max(call.sampling_params.max_tokens for call in calls if call.sampling_params is not None)
    assert together <= longest < alone


def test_a_bad_call_gets_its_error_and_the_others_still_run(sampler, prompts):
    calls = _calls(prompts)
    too_long = SampleCall(prompts[1], SamplingParams(max_tokens=10**6), use_base_model=True)
    unknown = SampleCall(prompts[1], SamplingParams(max_tokens=3), adapter_name="nobody")
    results = sampler.sample_many([calls[0], too_long, calls[1], unknown])
    with pytest.raises(InvalidInputError, match="exceeds the model's"):
        results[1].unwrap()
    with pytest.raises(InvalidInputError, match="unknown adapter 'nobody'"):
        results[3].unwrap()
    _assert_same(results[0].unwrap(), _alone(sampler, calls[0]))
    _assert_same(results[2].unwrap(), _alone(sampler, calls[1]))
