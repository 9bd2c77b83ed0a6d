"""GAE against a straightforward backwards loop over every position (veRL's masked formulation)."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.advantage import GAEAdvantage


def reference_gae(token_rewards, values, mask, gamma, lam):
    """Loop over *all* positions; a masked-out position passes the next value and advantage through unchanged."""
    advantages = np.zeros(len(values))
    next_value = last_advantage = 0.0
    for t in reversed(range(len(values))):
        delta = token_rewards[t] + gamma * next_value - values[t]
        advantage = delta + gamma * lam * last_advantage
        if mask[t]:
            advantages[t], next_value, last_advantage = advantage, values[t], advantage
    returns = np.where(mask, advantages + np.asarray(values), 0.0)
    return advantages, returns


def reference_whiten(advantages, masks, eps=1e-8):
    valid = np.concatenate([a[m.astype(bool)] for a, m in zip(advantages, masks, strict=True)])
    mean, var = valid.mean(), valid.var(ddof=1)
    return [np.where(m, (a - mean) / np.sqrt(var + eps), 0.0) for a, m in zip(advantages, masks, strict=True)]


def test_hand_computed_outcome_reward():
    # Valid values (0.2, 0.5), reward 1 at the end, gamma 1, lam 0.95:
    # t=2: delta = 1 - 0.5 = 0.5;  t=1: delta = 0.5 - 0.2 = 0.3, A = 0.3 + 0.95 * 0.5 = 0.775.
    advantages, returns = GAEAdvantage(normalize=False)([1.0], [[0.1, 0.2, 0.5]], [[0, 1, 1]])
    np.testing.assert_allclose(advantages[0], [0.0, 0.775, 0.5], rtol=1e-6)
    np.testing.assert_allclose(returns[0], [0.0, 0.975, 1.0], rtol=1e-6)
    assert advantages[0].dtype == returns[0].dtype == np.float32


def test_lambda_one_gives_monte_carlo_returns():
    values = [[0.3, -0.2, 0.9, 0.4]]
    advantages, returns = GAEAdvantage(gamma=0.9, lam=1.0, normalize=False)([[0.0, 1.0, 0.0, 2.0]], values)
    discounted = [1.0 * 0.9 + 2.0 * 0.9**3, 1.0 + 2.0 * 0.9**2, 2.0 * 0.9, 2.0]
    np.testing.assert_allclose(returns[0], discounted, rtol=1e-6)
    np.testing.assert_allclose(advantages[0], np.subtract(discounted, values[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0)])
@pytest.mark.parametrize("per_token", [False, True])
def test_matches_reference_loop_on_ragged_masked_batch(rng, gamma, lam, per_token):
    lengths = [7, 1, 12, 4]
    values = [rng.normal(size=n) for n in lengths]
    masks = [np.r_[np.zeros(n // 3), np.ones(n - n // 3 - n // 4), np.zeros(n // 4)] for n in lengths]
    masks[2][6] = 0  # a hole inside the completion (e.g. a tool response)
    if per_token:
        rewards = [rng.normal(size=n) for n in lengths]
        token_rewards = rewards
    else:
        rewards = rng.normal(size=len(lengths)).tolist()
        token_rewards = []
        for reward, mask in zip(rewards, masks, strict=True):
            row = np.zeros(mask.size)
            row[np.flatnonzero(mask)[-1]] = reward
            token_rewards.append(row)
    expected = [reference_gae(r, v, m, gamma, lam) for r, v, m in zip(token_rewards, values, masks, strict=True)]

    advantages, returns = GAEAdvantage(gamma=gamma, lam=lam, normalize=False)(rewards, values, masks)
    for (exp_adv, exp_ret), adv, ret in zip(expected, advantages, returns, strict=True):
        np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret, exp_ret, rtol=1e-5, atol=1e-6)

    whitened, whitened_returns = GAEAdvantage(gamma=gamma, lam=lam)(rewards, values, masks)
    for actual, exp in zip(whitened, reference_whiten([e[0] for e in expected], masks), strict=True):
        np.testing.assert_allclose(actual, exp, rtol=1e-4, atol=1e-5)
    for actual, exp in zip(whitened_returns, returns, strict=True):
        np.testing.assert_array_equal(actual, exp)  # returns are taken before whitening


def test_masked_out_positions_ignore_rewards_and_values():
    base = GAEAdvantage(normalize=False)([[0.0, 0.0, 1.0, 0.0]], [[0.0, 0.5, 0.25, 0.0]], [[0, 1, 1, 0]])
    noisy = GAEAdvantage(normalize=False)([[9.0, 0.0, 1.0, -9.0]], [[7.0, 0.5, 0.25, 3.0]], [[0, 1, 1, 0]])
    np.testing.assert_array_equal(base[0][0], noisy[0][0])
    np.testing.assert_array_equal(noisy[0][0][[0, 3]], [0.0, 0.0])
    np.testing.assert_array_equal(noisy[1][0][[0, 3]], [0.0, 0.0])


def test_no_masks_means_every_token_is_an_action():
    with_mask = GAEAdvantage()([1.0, 0.5], [[0.1, 0.2], [0.3, 0.4, 0.5]], [[1, 1], [1, 1, 1]])
    without = GAEAdvantage()([1.0, 0.5], [[0.1, 0.2], [0.3, 0.4, 0.5]])
    for a, b in zip(with_mask[0] + with_mask[1], without[0] + without[1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_single_valid_token_normalises_to_zero():
    advantages, returns = GAEAdvantage()([2.0], [[0.5]])
    np.testing.assert_array_equal(advantages[0], [0.0])
    np.testing.assert_allclose(returns[0], [2.0])
