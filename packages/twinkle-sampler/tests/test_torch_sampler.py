"""TorchSampler end to end: reference generation, determinism, layout, stops and training features."""

import torch

from twinkle.data_format import IGNORE_INDEX, SamplingParams
from twinkle.interfaces import Sampler as SamplerProtocol
from twinkle.registry import build
from twinkle.sampler import TorchSampler


def _hf_greedy(model, prompt_ids, max_new_tokens, eos_ids):
    prompt = torch.tensor([prompt_ids])
    output = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=0,
    )
    return output[0, prompt.shape[1] :].tolist()


def test_greedy_equals_transformers_generate(sampler, prompts):
    response = sampler.sample(prompts[:4], SamplingParams(max_tokens=10, temperature=0))
    for prompt, sequence in zip(prompts[:4], response.sequences, strict=True):
        assert sequence.tokens == _hf_greedy(sampler.model, prompt["input_ids"], 10, sampler.eos_token_ids)


def test_greedy_with_an_adapter_equals_the_peft_model(sampler, prompts, trained_model, lora_of):
    model = trained_model("tenant")
    sampler.add_adapter("tenant", *lora_of(model, "tenant"))
    response = sampler.sample(prompts[:3], SamplingParams(max_tokens=10, temperature=0), adapter_name="tenant")
    for prompt, sequence in zip(prompts[:3], response.sequences, strict=True):
        assert sequence.tokens == model.generate(prompt["input_ids"], max_new_tokens=10, adapter_name="tenant")[:10]
    assert len({tuple(s.tokens) for s in response.sequences}) > 1, "the adapter makes prompts diverge"


def test_a_fixed_seed_makes_sampling_deterministic(sampler, prompts):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    first, again = sampler.sample(prompts[:3], params), sampler.sample(prompts[:3], params)
    other = sampler.sample(prompts[:3], SamplingParams(max_tokens=8, temperature=1.0, seed=12))
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert [s.logprobs for s in first.sequences] == [s.logprobs for s in again.sequences]
    assert [s.tokens for s in first.sequences] != [s.tokens for s in other.sequences]


def test_num_samples_are_prompt_major(sampler, prompts):
    response = sampler.sample(prompts[:3], SamplingParams(max_tokens=4, seed=0, num_samples=2), num_samples=4)
    assert len(response.sequences) == 12
    assert response.prompt_token_ids == [p["input_ids"] for p in prompts[:3]]
    for index, sequence in enumerate(response.sequences):
        prompt_ids = prompts[index // 4]["input_ids"]
        assert sequence.new_input_feature["input_ids"][: len(prompt_ids)] == prompt_ids
    samples_of_first = {tuple(s.tokens) for s in response.sequences[:4]}
    assert len(samples_of_first) > 1, "repeats of a prompt are independent draws"
    assert len(sampler.sample(prompts[:2], SamplingParams(max_tokens=2, num_samples=3)).sequences) == 6


def test_max_tokens_ends_with_length(sampler, prompts):
    (sequence,) = sampler.sample(prompts[0], SamplingParams(max_tokens=5, seed=0)).sequences
    assert sequence.stop_reason == "length" and len(sequence.tokens) == len(sequence.logprobs) == 5


def test_stop_token_ids_end_the_completion_and_are_kept(sampler, prompts):
    free = sampler.sample(prompts[0], SamplingParams(max_tokens=8, seed=4)).sequences[0]
    stop_id = free.tokens[3]
    (stopped,) = sampler.sample(prompts[0], SamplingParams(max_tokens=8, seed=4, stop=[stop_id])).sequences
    cut = free.tokens.index(stop_id) + 1
    assert stopped.stop_reason == "stop" and stopped.tokens == free.tokens[:cut]
    assert set(sampler.eos_token_ids) >= {sampler.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_stop_strings_cut_the_text_and_keep_the_tokens_that_made_it(sampler, prompts):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=2, logprobs=False)
    free = sampler.sample(prompts[1], params).sequences[0]
    text = free.decoded
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    (stopped,) = sampler.sample(prompts[1], SamplingParams(**{**params.to_dict(), "stop": [stop]})).sequences
    assert stopped.stop_reason == "stop"
    assert stopped.decoded == text[: text.index(stop)]
    assert stopped.tokens == free.tokens[: len(stopped.tokens)]
    assert stop in sampler.decode(stopped.tokens) and stop not in sampler.decode(stopped.tokens[:-1])


def test_new_input_feature_is_ready_for_training_and_rewards(sampler, trajectories):
    with_reference = {
        **trajectories[0],
        "messages": [*trajectories[0]["messages"], {"role": "assistant", "content": "42"}],
    }
    response = sampler.sample([with_reference, trajectories[1]], SamplingParams(max_tokens=6, seed=0))
    for trajectory, sequence in zip(trajectories[:2], response.sequences, strict=True):
        feature = sequence.new_input_feature
        completion = len(sequence.tokens)
        assert feature["input_ids"][-completion:] == sequence.tokens
        assert feature["labels"][-completion:] == sequence.tokens
        assert set(feature["labels"][:-completion]) == {IGNORE_INDEX}
        assert feature["loss_mask"] == [int(label != IGNORE_INDEX) for label in feature["labels"]]
        assert feature["messages"] == [*trajectory["messages"], {"role": "assistant", "content": sequence.decoded}]
        assert feature["user_data"] == trajectory["user_data"]


def test_topk_logprobs_are_sorted_and_include_the_greedy_choice(sampler, prompts):
    (sequence,) = sampler.sample(prompts[0], SamplingParams(max_tokens=4, temperature=0, logprobs=3)).sequences
    for token, logprob, top in zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs, strict=True):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == token and abs(top[0][1] - logprob) < 1e-6


def test_resolves_by_name_and_meets_the_core_protocol(sampler):
    assert isinstance(sampler, SamplerProtocol)
    from twinkle.registry import get_registry

    assert get_registry("sampler").get("TorchSampler") is TorchSampler
    assert build("sampler", sampler) is sampler
