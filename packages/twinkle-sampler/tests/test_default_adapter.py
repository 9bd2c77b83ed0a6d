"""Which weights a call samples: a named adapter, the sampler's only adapter, or the base model when asked."""

import pytest

from twinkle.data_format import SamplingParams
from twinkle.errors import InvalidInputError

PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _logprobs(response):
    return [s.logprobs for s in response.sequences]


def test_without_a_name_the_only_adapter_samples(sampler, prompts, trained_model, lora_of):
    base = sampler.sample(prompts[:2], PARAMS)  # no adapter served: the base model
    sampler.add_adapter("policy", *lora_of(trained_model("policy"), "policy"))  # what sync_weights does
    unnamed = sampler.sample(prompts[:2], PARAMS)
    named = sampler.sample(prompts[:2], PARAMS, adapter_name="policy")
    asked_for_base = sampler.sample(prompts[:2], PARAMS, use_base_model=True)
    assert _logprobs(unnamed) == _logprobs(named)
    assert _logprobs(asked_for_base) == _logprobs(base)
    assert _logprobs(unnamed) != _logprobs(base), "the adapter changes what is sampled"


def test_without_a_name_several_adapters_are_refused_by_name(sampler, prompts, trained_model, lora_of):
    model = trained_model("a", "b")
    for name in ("a", "b"):
        sampler.add_adapter(name, *lora_of(model, name))
    with pytest.raises(InvalidInputError, match=r"serves several adapters \['a', 'b'\]: .*use_base_model=True"):
        sampler.sample(prompts[:1], PARAMS)
    rows = sampler.sample(prompts[:2], GREEDY, adapter_name=["b", None])  # per input; None is the base model
    (base,) = sampler.sample(prompts[1], GREEDY, use_base_model=True).sequences
    assert rows.sequences[1].tokens == base.tokens
    assert max(abs(a - b) for a, b in zip(rows.sequences[1].logprobs, base.logprobs, strict=True)) <= 1e-5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"adapter_name": "policy", "use_base_model": True}, "do not also pass adapter_name='policy'"),
        ({"use_base_model": "yes"}, "use_base_model must be True or False"),
    ],
)
def test_contradictory_requests_are_refused(sampler, prompts, trained_model, lora_of, kwargs, message):
    sampler.add_adapter("policy", *lora_of(trained_model("policy"), "policy"))
    with pytest.raises(InvalidInputError, match=message):
        sampler.sample(prompts[:1], PARAMS, **kwargs)
