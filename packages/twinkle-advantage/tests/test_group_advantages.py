"""GRPO, RLOO and REINFORCE++ against hand-computed cases and direct numpy re-derivations."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.advantage import GRPOAdvantage, ReinforcePlusPlusAdvantage, RLOOAdvantage, from_groups, to_groups

SQRT_HALF = np.sqrt(0.5)


def test_grpo_hand_computed():
    # Groups (1, 0) and (0, 0): mean 0.5, sample std sqrt(0.5); the second group carries no signal.
    rewards = [1.0, 0.0, 0.0, 0.0]
    expected_group = [0.5 / SQRT_HALF, -0.5 / SQRT_HALF, 0.0, 0.0]
    np.testing.assert_allclose(GRPOAdvantage()(rewards, num_generations=2), expected_group, rtol=1e-5)
    np.testing.assert_allclose(GRPOAdvantage()(rewards, num_generations=2, scale="none"), [0.5, -0.5, 0, 0])
    batch_std = np.std(rewards, ddof=1)  # 0.5
    np.testing.assert_allclose(
        GRPOAdvantage()(rewards, num_generations=2, scale="batch"), [0.5 / batch_std, -0.5 / batch_std, 0, 0], 1e-5
    )


def test_grpo_seed_usage_returns_array_with_tolist():
    total_rewards = [2.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    advantages = GRPOAdvantage()(total_rewards, num_generations=4, scale="group")
    assert isinstance(advantages, np.ndarray) and advantages.dtype == np.float32
    values = advantages.tolist()
    assert isinstance(values, list) and all(isinstance(v, float) for v in values)
    assert values[4:] == [0.0] * 4  # all-equal group: no signal, no 0/0


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_matches_numpy_rederivation(rng, layout, scale):
    prompts, generations, eps = 5, 6, 1e-6
    rewards = rng.normal(size=prompts * generations)
    prompt_of = np.arange(rewards.size) // generations if layout == "contiguous" else np.arange(rewards.size) % prompts
    expected = np.empty_like(rewards)
    for i, r in enumerate(rewards):
        group = rewards[prompt_of == prompt_of[i]]
        divisor = {"group": group.std(ddof=1) + eps, "batch": rewards.std(ddof=1) + eps, "none": 1.0}[scale]
        expected[i] = (r - group.mean()) / divisor
    actual = GRPOAdvantage(group_layout=layout)(rewards, num_generations=generations, scale=scale)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    assert abs(actual.sum()) < 1e-4  # every group's advantages sum to 0


def test_a_hand_interleaved_batch_needs_its_layout():
    """Two sampling rounds over prompts a, b, c, concatenated: prompt p's completions sit at p and p + P."""
    rounds = ["a", "b", "c"] * 2
    rewards = [{"a": 1.0, "b": 0.0, "c": 5.0}[p] + 0.5 * (i >= 3) for i, p in enumerate(rounds)]
    advantages = GRPOAdvantage()(rewards, num_generations=2, scale="none", group_layout="interleaved")
    np.testing.assert_allclose(advantages, [-0.25, -0.25, -0.25, 0.25, 0.25, 0.25])
    wrong = GRPOAdvantage()(rewards, num_generations=2, scale="none")  # the default assumes prompt-major
    assert not np.allclose(wrong, advantages)


def test_grpo_degenerate_groups_and_overrides():
    np.testing.assert_array_equal(GRPOAdvantage()([3.0, -1.0, 7.0], num_generations=1), [0.0, 0.0, 0.0])
    configured, centred = GRPOAdvantage(scale="none", eps=0.5), np.array([0.5, -0.5])
    np.testing.assert_allclose(configured([1.0, 0.0], num_generations=2), centred)
    np.testing.assert_allclose(configured([1.0, 0.0], num_generations=2, scale="group"), centred / (SQRT_HALF + 0.5))
    np.testing.assert_allclose(
        configured([1.0, 0.0], num_generations=2, scale="group", eps=1e-6), centred / (SQRT_HALF + 1e-6), 1e-5
    )


def test_rloo_hand_computed_and_rederived(rng):
    # Group (1, 0, 0): baselines 0, 0.5, 0.5.
    np.testing.assert_allclose(RLOOAdvantage()([1.0, 0.0, 0.0], num_generations=3), [1.0, -0.5, -0.5])
    rewards = rng.uniform(size=12)
    expected = [r - np.delete(rewards[i // 4 * 4 : i // 4 * 4 + 4], i % 4).mean() for i, r in enumerate(rewards)]
    np.testing.assert_allclose(RLOOAdvantage()(rewards, num_generations=4), expected, rtol=1e-5, atol=1e-6)
    interleaved = RLOOAdvantage(group_layout="interleaved")(rewards, num_generations=4)
    grouped = rewards.reshape(4, 3).T  # prompt p = samples p, p + 3, p + 6, p + 9
    expected_interleaved = (grouped - (grouped.sum(1, keepdims=True) - grouped) / 3).T.reshape(-1)
    np.testing.assert_allclose(interleaved, expected_interleaved, rtol=1e-5, atol=1e-6)


def test_reinforce_plus_plus_hand_computed_and_rederived(rng):
    # Centred: (0.5, -0.5, 0, 0); population std over the batch = sqrt(0.125).
    expected = np.array([0.5, -0.5, 0.0, 0.0]) / (np.sqrt(0.125) + 1e-6)
    np.testing.assert_allclose(ReinforcePlusPlusAdvantage()([1.0, 0.0, 0.0, 0.0], num_generations=2), expected, 1e-5)
    rewards = rng.normal(size=20)
    centred = rewards - np.repeat(rewards.reshape(5, 4).mean(1), 4)
    whitened = (centred - centred.mean()) / (centred.std() + 1e-6)
    np.testing.assert_allclose(ReinforcePlusPlusAdvantage()(rewards, num_generations=4), whitened, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_grouping_round_trips(layout):
    rewards = np.arange(12.0)
    groups = to_groups(rewards, 3, layout)
    assert groups.shape == (4, 3)
    expected_first = [0.0, 1.0, 2.0] if layout == "contiguous" else [0.0, 4.0, 8.0]
    assert groups[0].tolist() == expected_first
    np.testing.assert_array_equal(from_groups(groups, layout), rewards)


def test_accepts_numpy_and_tensors():
    torch = pytest.importorskip("torch")
    expected = GRPOAdvantage()([1.0, 0.0], num_generations=2)
    np.testing.assert_array_equal(GRPOAdvantage()(np.array([1.0, 0.0]), num_generations=np.int64(2)), expected)
    np.testing.assert_array_equal(GRPOAdvantage()(torch.tensor([1.0, 0.0]), num_generations=2), expected)
    rewards_with_grad = torch.tensor([1.0, 0.0], requires_grad=True)  # straight from a reward model
    np.testing.assert_array_equal(GRPOAdvantage()(rewards_with_grad, num_generations=2), expected)
