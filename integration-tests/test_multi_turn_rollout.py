"""Multi-turn rollouts with the real sampler, template and trainer: log-prob parity, env tokens untrained."""

from __future__ import annotations

import pytest

from twinkle.data_format import SamplingParams
from twinkle.env import EnvGroup, rollout

# The random-weight model rarely writes its end-of-turn token; stopping on a third of the vocabulary ends each turn
# after a few tokens, so episodes run several turns (a stop id ends the turn; the rollout closes it untrained).
STOP_IDS = list(range(1000, 151000, 3))


@pytest.fixture(scope="module")
def sampler():
    from twinkle.sampler import TorchSampler

    sampler = TorchSampler(model_id="builtin://qwen3-tiny")
    sampler.set_template("Template", enable_thinking=False)
    return sampler


@pytest.mark.integration
def test_trainer_logprobs_equal_the_samplers_over_whole_multi_turn_episodes(sampler) -> None:
    from twinkle.model import TransformersModel

    groups = [EnvGroup("GuessNumberEnv", group_size=2, seed=seed, max_guesses=3) for seed in range(3)]
    params = SamplingParams(max_tokens=16, stop=STOP_IDS, seed=0)
    episodes = rollout(sampler, sampler.template, groups, params, max_turns=3, max_tokens=512)
    assert len(episodes) == 6
    assert max(episode.num_turns for episode in episodes) >= 2  # multi-turn for real
    model = TransformersModel(model_id="builtin://qwen3-tiny")
    features = [episode.to_input_feature() for episode in episodes]
    output = model.forward(inputs=features)
    for episode, feature, logps in zip(episodes, features, output.logps, strict=True):
        assert len(episode.logprobs) == sum(feature["loss_mask"]) == sum(episode.model_mask)
        trainer = [
            lp for lp, trained in zip(logps.tolist()[: feature["length"]], feature["loss_mask"], strict=True) if trained
        ]
        assert max(abs(a - b) for a, b in zip(trainer, episode.logprobs, strict=True)) < 1e-5
        text = sampler.template.decode([t for t, m in zip(episode.input_ids, episode.model_mask, strict=True) if not m])
        if episode.num_turns >= 2:  # the env's feedback is in the sequence, untrained
            assert "<|im_start|>user\nHigher." in text or "<|im_start|>user\nLower." in text or "one number" in text


@pytest.mark.integration
def test_a_group_shares_its_task_and_budgets_end_episodes(sampler) -> None:
    group = EnvGroup("CalculatorEnv", group_size=3, seed=11)
    episodes = rollout(
        sampler, sampler.template, [group], SamplingParams(max_tokens=8, seed=1), max_turns=2, max_tokens=300
    )
    assert len({episode.messages[0]["content"] for episode in episodes}) == 1  # one task, three attempts
    assert "<tools>" in sampler.template.decode(episodes[0].input_ids)  # the calculator is offered
    assert all(episode.end == "max_tokens" for episode in episodes)  # 8 tokens end no turn of the random model
    assert all(len(episode.logprobs) == 8 for episode in episodes)
