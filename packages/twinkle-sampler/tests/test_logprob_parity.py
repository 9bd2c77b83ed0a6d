"""Sampler log-probs are the trainer's log-probs: the importance ratio of a fresh policy starts at exactly 1."""

from twinkle.data_format import SamplingParams


def _assert_close(actual, expected, atol=1e-5):
    assert len(actual) == len(expected)
    for ours, theirs in zip(actual, expected, strict=True):
        assert len(ours) == len(theirs)
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= atol


def test_sampled_logprobs_equal_trainer_forward_only(sampler, prompts, trained_model, completion_logps):
    model = trained_model()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    response = sampler.sample(prompts[:4], params, num_samples=2)
    _assert_close([s.logprobs for s in response.sequences], completion_logps(model, response.sequences))


def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling_transform(
    sampler, prompts, trained_model, completion_logps
):
    """Temperature, top-k, top-p and penalties change which token is drawn, never the log-prob reported for it."""
    model = trained_model()
    params = SamplingParams(max_tokens=8, temperature=0.6, top_k=20, top_p=0.8, repetition_penalty=1.3, seed=0)
    response = sampler.sample(prompts[:3], params)
    _assert_close([s.logprobs for s in response.sequences], completion_logps(model, response.sequences))


def test_adapter_logprobs_equal_trainer_with_that_adapter(sampler, prompts, trained_model, lora_of, completion_logps):
    model = trained_model("tenant")
    sampler.add_adapter("tenant", *lora_of(model, "tenant"))
    response = sampler.sample(prompts[:3], SamplingParams(max_tokens=10, seed=5), adapter_name="tenant")
    expected = completion_logps(model, response.sequences, adapter_name="tenant")
    _assert_close([s.logprobs for s in response.sequences], expected)


def test_prompt_logprobs_equal_trainer_logps_of_the_prompt(sampler, prompts, trained_model):
    model = trained_model()
    response = sampler.sample(prompts[:3], SamplingParams(max_tokens=1, prompt_logprobs=3))
    features = [{"input_ids": p["input_ids"], "labels": p["input_ids"]} for p in prompts[:3]]
    expected = [logps[1:].tolist() for logps in model.forward_only(inputs=features).logps]
    assert all(row[0] is None for row in response.prompt_logprobs)
    _assert_close([row[1:] for row in response.prompt_logprobs], expected)
    for row, alternatives in zip(response.prompt_logprobs, response.topk_prompt_logprobs, strict=True):
        assert alternatives[0] is None and all(len(top) == 3 for top in alternatives[1:])
        assert all(top[0][1] >= logprob - 1e-6 for top, logprob in zip(alternatives[1:], row[1:], strict=True))
