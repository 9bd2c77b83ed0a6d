"""Requests that cannot be served fail before any compute, with an error naming what to fix."""

import pytest

from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.sampler import TorchSampler

SHORT = SamplingParams(max_tokens=3)


@pytest.mark.parametrize(
    ("inputs", "kwargs", "message"),
    [
        ([{"input_ids": [1, 2]}], {"num_samples": 0}, r"num_samples must be an int >= 1, got 0"),
        ([{"input_ids": []}], {}, r"inputs\[0\]\.input_ids is empty"),
        ([], {}, r"inputs is empty"),
        ("a prompt", {}, r"inputs must be a list"),
        ([{"input_ids": [1, 2]}, {"input_ids": [5, 10**6]}], {}, r"inputs\[1\]\.input_ids contains ids outside"),
        ([{"input_ids": [1, 2]}], {"adapter_name": "nobody"}, r"unknown adapter 'nobody' \(inputs\[0\]\)"),
        ([{"input_ids": [1]}, {"input_ids": [2]}], {"adapter_name": [None]}, r"one entry per input \(2\)"),
        ([{"input_ids": [1, 2]}], {"sampling_params": {"max_tokens": 3}}, r"must be a SamplingParams"),
    ],
    ids=[
        "num-samples-0",
        "empty-prompt",
        "no-inputs",
        "a-string",
        "id-outside-vocab",
        "unknown-adapter",
        "adapter-list-length",
        "params-dict",
    ],
)
def test_bad_requests_are_rejected_with_the_culprit_named(sampler, inputs, kwargs, message):
    kwargs = {"sampling_params": SHORT, **kwargs}
    with pytest.raises(InvalidInputError, match=message):
        sampler.sample(inputs, **kwargs)


def test_a_stop_string_longer_than_max_tokens_could_never_match(sampler):
    with pytest.raises(
        InvalidInputError, match=r"stop string 'the end of the story' is \d+ tokens long but max_tokens=2"
    ):
        sampler.sample([{"input_ids": [1, 2]}], SamplingParams(max_tokens=2, stop=["the end of the story"]))
    with pytest.raises(InvalidInputError, match=r"stop id 999999999 is outside the vocabulary"):
        sampler.sample([{"input_ids": [1, 2]}], SamplingParams(max_tokens=2, stop=[999999999]))


def test_prompts_that_leave_no_room_for_max_tokens(sampler):
    too_long = SamplingParams(max_tokens=sampler.max_model_len)
    with pytest.raises(InvalidInputError, match=r"inputs\[0\] has 2 tokens: with max_tokens=\d+ it exceeds"):
        sampler.sample([{"input_ids": [1, 2]}], too_long)


def test_trajectories_need_a_template(trajectories):
    bare = TorchSampler(device="cpu")
    with pytest.raises(ConfigurationError, match=r"inputs\[0\] is a trajectory; call set_template"):
        bare.sample(trajectories[:1], SHORT)
    (sequence,) = bare.sample([{"input_ids": [1, 2, 3]}], SHORT).sequences  # ids need none
    assert len(sequence.tokens) == 3 and "messages" not in sequence.new_input_feature
