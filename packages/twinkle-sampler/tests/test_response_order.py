"""Responses are prompt-major: identical prompts are one group, however the inputs repeat them."""

from twinkle.data_format import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=1.0, seed=0)


def _tagged(prompts, order):
    """``prompts[p]`` for each ``p`` of ``order``, each copy tagged with its position in the inputs."""
    return [{**prompts[p], "user_data": {"position": i}} for i, p in enumerate(order)]


def _prompt_of(sequence, prompts):
    return next(
        i
        for i, p in enumerate(prompts)
        if sequence.new_input_feature["input_ids"][: len(p["input_ids"])] == p["input_ids"]
    )


def test_repeating_the_batch_groups_each_prompts_completions_together(sampler, prompts):
    inputs = _tagged(prompts, [0, 1, 2] * 2)  # what the seed's sample(global_prompts * NUM_GENERATIONS) sends
    response = sampler.sample(inputs, PARAMS)
    assert [s.input_index for s in response.sequences] == [0, 3, 1, 4, 2, 5]
    assert [_prompt_of(s, prompts) for s in response.sequences] == [0, 0, 1, 1, 2, 2]
    for sequence in response.sequences:  # each completion keeps its own input's feature (user_data)
        assert sequence.new_input_feature["user_data"] == {"position": sequence.input_index}
    assert response.prompt_token_ids == [p["input_ids"] for p in inputs], "prompt-level fields follow the inputs"
    tokens = {tuple(s.tokens) for s in response.sequences[:2]}
    assert len(tokens) == 2, "the copies of a prompt are independent draws"


def test_num_samples_and_repeats_give_the_same_layout(sampler, prompts):
    repeated = sampler.sample(prompts[:2] * 3, PARAMS)
    sampled = sampler.sample(prompts[:2], PARAMS, num_samples=3)
    layout = [[_prompt_of(s, prompts) for s in r.sequences] for r in (repeated, sampled)]
    assert layout[0] == layout[1] == [0, 0, 0, 1, 1, 1]
    assert [s.input_index for s in sampled.sequences] == [0, 0, 0, 1, 1, 1]
    both = sampler.sample(_tagged(prompts, [0, 1, 0]), PARAMS, num_samples=2)
    assert [s.input_index for s in both.sequences] == [0, 0, 2, 2, 1, 1]


def test_the_same_prompt_under_another_adapter_is_another_group(sampler, prompts, trained_model, lora_of):
    sampler.add_adapter("policy", *lora_of(trained_model("policy"), "policy"))
    response = sampler.sample([prompts[0]] * 3, PARAMS, adapter_name=["policy", None, "policy"])
    assert [s.input_index for s in response.sequences] == [0, 2, 1]
