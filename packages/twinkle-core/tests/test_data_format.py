import json

import pytest

from twinkle.data_format import (
    IGNORE_INDEX,
    LossOutput,
    ModelOutput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    make_input_feature,
    prompt_major,
    validate_input_feature,
    validate_trajectory,
)
from twinkle.errors import InvalidInputError


def test_make_input_feature_fills_masks_positions_and_loss_mask():
    feature = make_input_feature([5, 6, 7], labels=[IGNORE_INDEX, 6, 7], user_data={"answer": "3"})
    assert feature["attention_mask"] == [1, 1, 1]
    assert feature["position_ids"] == [0, 1, 2]
    assert feature["loss_mask"] == [0, 1, 1]
    assert feature["length"] == 3
    assert feature["user_data"] == {"answer": "3"}


@pytest.mark.parametrize(
    ("feature", "message"),
    [
        ({"input_ids": []}, "input_ids is empty"),
        ({"labels": [1]}, "no 'input_ids'"),
        ({"input_ids": [1, 2], "labels": [1]}, "labels has length 1 but input_ids has length 2"),
        ({"input_ids": [1, "a"]}, r"input_ids\[1\] must be an int"),
        ({"input_ids": [1, 2], "labels": [1, True]}, r"labels\[1\] must be an int, got True"),
        ({"input_ids": [1, -3]}, "negative"),
        ({"input_ids": [1, 2], "labels": [IGNORE_INDEX, 2], "loss_mask": [1, 1]}, r"loss_mask\[0\]=1 disagrees"),
        ({"input_ids": [1, 2], "length": 5}, "length is 5"),
        ("not a dict", "must be a dict"),
    ],
)
def test_validate_input_feature_names_the_problem(feature, message):
    with pytest.raises(InvalidInputError, match=message):
        validate_input_feature(feature)


def test_validate_input_feature_rejects_ids_outside_vocabulary():
    with pytest.raises(InvalidInputError, match=r"outside the vocabulary \[0, 10\): \[10, 99\]"):
        validate_input_feature({"input_ids": [1, 10, 99]}, vocab_size=10)
    with pytest.raises(InvalidInputError, match=r"outside the vocabulary \[0, 10\): \[-1\]"):
        validate_input_feature({"input_ids": [-1, 9]}, vocab_size=10)
    assert validate_input_feature({"input_ids": [0, 9]}, vocab_size=10)["input_ids"] == [0, 9]


def test_validate_input_feature_accepts_array_likes():
    class ArrayLike:
        def tolist(self):
            return [3, 4]

    assert validate_input_feature({"input_ids": ArrayLike()})["input_ids"] == [3, 4]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, r"messages\[0\]\.role must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\]\.content must be a string"),
        ({"messages": [{"role": "user", "content": "x"}], "user_data": [1]}, "user_data must be a dict"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": "AAA"}]},
            r"messages\[0\]\.tool_calls must be a list",
        ),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]}]},
            r"messages\[0\]\.tool_calls\[0\] must be",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "rejected_messages": [{"role": "user"}]},
            r"rejected_messages\[0\]\.content must be a string",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "rejected_messages": []}, "rejected_messages must be"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "search"}, "tools must be a list"),
    ],
)
def test_validate_trajectory_names_the_field(row, message):
    with pytest.raises(InvalidInputError, match=message):
        validate_trajectory(row)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"num_samples": 0}, "num_samples"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"logprobs": -2}, "logprobs"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_json_round_trip_and_unknown_fields():
    params = SamplingParams(max_tokens=8, temperature=0.0, stop="\n\n", seed=3)
    assert params.stop == ["\n\n"]
    restored = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert restored == params
    with pytest.raises(InvalidInputError, match=r"unknown field\(s\) \['max_new_tokens'\]"):
        SamplingParams.from_dict({"max_new_tokens": 3})


def test_sample_response_round_trip_with_nested_sequences():
    feature = make_input_feature([1, 2, 3], labels=[IGNORE_INDEX, 2, 3])
    response = SampleResponse(
        sequences=[
            SampledSequence(tokens=[2, 3], stop_reason="stop", logprobs=[-0.1, -0.2], new_input_feature=feature)
        ],
        prompt_token_ids=[[1]],
    )
    restored = SampleResponse.from_dict(json.loads(json.dumps(response.to_dict())))
    assert restored == response
    assert isinstance(restored.sequences[0], SampledSequence)


def _answers(*inputs):
    """A response of one sampler to inputs ``(prompt ids, adapter)``: one completion each, echoing its prompt."""
    order = prompt_major(inputs)
    sequences = [SampledSequence(list(inputs[i][0]), "stop", input_index=i, adapter_name=inputs[i][1]) for i in order]
    return SampleResponse(
        sequences, prompt_token_ids=[list(ids) for ids, _ in inputs], prompt_logprobs=[[None]] * len(inputs)
    )


def test_prompt_major_groups_equal_keys_in_order_of_first_appearance():
    assert prompt_major(["a", "b", "a", "c", "b"]) == [0, 2, 1, 4, 3]
    assert prompt_major([]) == []


def test_responses_of_consecutive_shares_concatenate_into_one_prompt_major_response():
    p, q = (1, 2), (3,)
    shares = [[(p, None), (q, None)], [(p, None), (q, None), (p, "a")], [(p, "a")]]  # [p, q, p, q, p/a, p/a]
    merged = SampleResponse.concatenate([_answers(*share) for share in shares])
    whole = _answers(*[item for share in shares for item in share])
    assert [s.input_index for s in merged.sequences] == [0, 2, 1, 3, 4, 5]
    assert merged == whole  # as if one sampler had sampled every input
    with pytest.raises(InvalidInputError, match="needs prompt_token_ids and an input_index"):
        SampleResponse.concatenate([SampleResponse([SampledSequence([1], "stop")], prompt_token_ids=[[1]])])


def test_outputs_default_to_empty_metrics():
    assert LossOutput(loss=1.0).metrics == {}
    assert ModelOutput().to_dict()["num_tokens"] == 0


def test_trajectory_images_must_be_a_list_of_image_forms():
    messages = [{"role": "user", "content": "<image>Hi"}]
    for images in (["a.png"], [b"\x89PNG"], [{"bytes": b"\x89PNG", "path": None}], [{"path": "a.png"}]):
        validate_trajectory({"messages": messages, "images": images})
    with pytest.raises(InvalidInputError, match=r"trajectory\.images must be a list of images, got str"):
        validate_trajectory({"messages": messages, "images": "a.png"})
    with pytest.raises(InvalidInputError, match=r"trajectory.images\[1\] must be a path, a data URI, bytes"):
        validate_trajectory({"messages": messages, "images": ["a.png", 3]})
    with pytest.raises(InvalidInputError, match=r"trajectory.images\[0\] must be"):
        validate_trajectory({"messages": messages, "images": [{"bytes": None, "path": None}]})


def test_image_features_are_checked():
    feature = {"input_ids": [1, 2, 3], "mm_token_type_ids": [0, 1, 0], "pixel_values": [[0.5]], "image_grid_thw": None}
    with pytest.raises(InvalidInputError, match="needs both pixel_values and image_grid_thw, or neither"):
        validate_input_feature(feature)
    with pytest.raises(InvalidInputError, match="mm_token_type_ids has length 2 but input_ids has 3"):
        validate_input_feature({"input_ids": [1, 2, 3], "mm_token_type_ids": [0, 1]})
