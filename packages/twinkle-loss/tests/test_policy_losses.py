"""Every policy loss against a per-sample reference written from its paper or Tinker's docs: values and gradients."""

import math

import pytest
import torch

from twinkle.loss import CISPOLoss, DRGRPOLoss, DROLoss, GRPOLoss, GSPOLoss, ImportanceSamplingLoss, PPOLoss


def _grads(loss, data):
    return torch.autograd.grad(loss, data.leaves)


def _assert_same(got, expected, data):
    """Same loss value and same gradient for every sample's log-probs."""
    torch.testing.assert_close(got, expected)
    for grad, expected_grad in zip(_grads(got, data), _grads(expected, data), strict=True):
        torch.testing.assert_close(grad, expected_grad)


def _ppo_tokens(ratio, advantages, low, high):
    """−min(r·A, clip(r)·A) piecewise: for A > 0 the ratio is capped at ``high``, for A < 0 floored at ``low``."""
    losses = []
    for r, a in zip(ratio, advantages, strict=True):
        bounded = torch.clamp(r, max=high) if a > 0 else torch.clamp(r, min=low)
        losses.append(-bounded * a)
    return torch.stack(losses)


def _k3(ref, lp):
    return torch.exp(ref - lp) - (ref - lp) - 1


@pytest.mark.parametrize("reduction", ["token_mean", "token_sum", "sequence_mean"])
def test_grpo_matches_the_clipped_objective_with_kl(data, layout, reduction, reference_reduce):
    inputs, outputs = data.batch(layout)
    loss = GRPOLoss(epsilon=0.2, epsilon_high=0.28, beta=0.05, reduction=reduction)
    got = loss(
        inputs,
        outputs,
        advantages=[s.advantage for s in data.samples],
        old_logps=[s.old for s in data.samples],
        ref_logps=[s.ref for s in data.samples],
    ).loss
    per_sample = []
    for s in data.samples:
        old, ref = torch.tensor(s.old, dtype=torch.float64), torch.tensor(s.ref, dtype=torch.float64)
        ratio = torch.exp(s.logps - old)
        surrogate = _ppo_tokens(ratio, [s.advantage] * len(s.old), 0.8, 1.28)
        per_sample.append(surrogate + 0.05 * _k3(ref, s.logps))
    _assert_same(got, reference_reduce(per_sample, reduction), data)


def test_on_policy_default_is_reinforce_with_ratio_one(data, layout):
    inputs, outputs = data.batch(layout)
    result = GRPOLoss()(inputs, outputs, advantages=[s.advantage for s in data.samples])
    tokens = sum(len(s.old) for s in data.samples)
    expected = -sum(s.advantage * len(s.old) for s in data.samples) / tokens
    assert result.loss.item() == pytest.approx(expected)
    for grad, s in zip(_grads(result.loss, data), data.samples, strict=True):
        torch.testing.assert_close(grad, torch.full_like(grad, -s.advantage / tokens))
    assert result.metrics["ratio"] == pytest.approx(1.0)
    assert result.metrics["approx_kl"] == result.metrics["abs_log_ratio_max"] == 0.0
    assert result.metrics["clip_low_fraction"] == result.metrics["clip_high_fraction"] == 0.0


def test_ppo_with_tinker_thresholds_is_tinkers_ppo(data, layout):
    """Tinker's ppo: clamp(prob_ratio, clip_low_threshold, clip_high_threshold), min, then -sum."""
    inputs, outputs = data.batch(layout)
    lo, hi = 0.8, 1.3
    loss = PPOLoss(epsilon=1 - lo, epsilon_high=hi - 1, reduction="token_sum")
    got = loss(
        inputs,
        outputs,
        advantages=[s.token_advantages for s in data.samples],
        old_logps=[s.old for s in data.samples],
    ).loss
    target = torch.cat(data.leaves)
    sampling = torch.tensor([v for s in data.samples for v in s.old], dtype=torch.float64)
    advantages = torch.tensor([v for s in data.samples for v in s.token_advantages], dtype=torch.float64)
    prob_ratio = torch.exp(target - sampling)
    clipped_ratio = torch.clamp(prob_ratio, lo, hi)
    expected = -torch.min(prob_ratio * advantages, clipped_ratio * advantages).sum()
    _assert_same(got, expected, data)


def test_policy_metrics_are_token_means_or_maxima_over_trained_tokens(data, layout):
    inputs, outputs = data.batch(layout)
    metrics = GRPOLoss(epsilon=0.1, beta=0.1)(
        inputs,
        outputs,
        advantages=[s.advantage for s in data.samples],
        old_logps=[s.old for s in data.samples],
        ref_logps=[s.ref for s in data.samples],
    ).metrics
    low = high = 0
    ratios, approx_kl, kl = [], [], []
    for s in data.samples:
        for lp, q, ref in zip(s.logps.tolist(), s.old, s.ref, strict=True):
            r = math.exp(lp - q)
            low += r < 0.9 and s.advantage < 0
            high += r > 1.1 and s.advantage > 0
            ratios.append(r)
            approx_kl.append(r - 1 - math.log(r))
            kl.append(math.exp(ref - lp) - (ref - lp) - 1)
    n = len(ratios)
    assert low + high > 0
    assert metrics["clip_low_fraction"] == pytest.approx(low / n)
    assert metrics["clip_high_fraction"] == pytest.approx(high / n)
    assert metrics["ratio"] == pytest.approx(sum(ratios) / n)
    assert metrics["approx_kl"] == pytest.approx(sum(approx_kl) / n)
    assert metrics["kl"] == pytest.approx(sum(kl) / n)
    gaps = [abs(lp - q) for s in data.samples for lp, q in zip(s.logps.tolist(), s.old, strict=True)]
    assert metrics["abs_log_ratio_max"] == pytest.approx(max(gaps))


def test_dr_grpo_divides_token_sums_by_sequences_times_max_length(data, layout):
    inputs, outputs = data.batch(layout)
    got = DRGRPOLoss(max_length=8)(
        inputs, outputs, advantages=[s.advantage for s in data.samples], old_logps=[s.old for s in data.samples]
    ).loss
    total = 0
    for s in data.samples:
        ratio = torch.exp(s.logps - torch.tensor(s.old, dtype=torch.float64))
        total = total + _ppo_tokens(ratio, [s.advantage] * len(s.old), 0.8, 1.2).sum()
    _assert_same(got, total / (len(data.samples) * 8), data)


@pytest.mark.parametrize(("epsilon", "epsilon_high"), [(3e-4, 4e-4), (0.2, 0.2)])
def test_gspo_equals_the_sequence_level_objective(data, layout, epsilon, epsilon_high):
    inputs, outputs = data.batch(layout)
    loss = GSPOLoss(epsilon=epsilon, epsilon_high=epsilon_high)
    got = loss(
        inputs, outputs, advantages=[s.advantage for s in data.samples], old_logps=[s.old for s in data.samples]
    ).loss
    per_sequence = []
    for s in data.samples:
        s_i = torch.exp((s.logps - torch.tensor(s.old, dtype=torch.float64)).mean())
        clipped = torch.clamp(s_i, 1 - epsilon, 1 + epsilon_high)
        per_sequence.append(-torch.min(s_i * s.advantage, clipped * s.advantage))
    _assert_same(got, torch.stack(per_sequence).mean(), data)


def test_gspo_token_with_per_token_advantages_and_token_sum(data, layout):
    """GSPO-token as SkyRL (and Tinker's gspo) write it: sg(s_i)·exp(lp − sg(lp)), clipped per token, summed."""
    inputs, outputs = data.batch(layout)
    got = GSPOLoss(epsilon=0.05, epsilon_high=0.05, reduction="token_sum")(
        inputs, outputs, advantages=[s.token_advantages for s in data.samples], old_logps=[s.old for s in data.samples]
    ).loss
    total = 0
    for s in data.samples:
        log_ratio = s.logps - torch.tensor(s.old, dtype=torch.float64)
        ratio = torch.exp(log_ratio.mean().detach() + s.logps - s.logps.detach())
        total = total + _ppo_tokens(ratio, s.token_advantages, 0.95, 1.05).sum()
    _assert_same(got, total, data)


@pytest.mark.parametrize(("epsilon", "epsilon_high", "reduction"), [(0.2, 0.28, "token_mean"), (1.0, 3.0, "token_sum")])
def test_cispo_weights_log_probs_by_the_clipped_detached_ratio(
    data, layout, reference_reduce, epsilon, epsilon_high, reduction
):
    inputs, outputs = data.batch(layout)
    result = CISPOLoss(epsilon=epsilon, epsilon_high=epsilon_high, reduction=reduction)(
        inputs, outputs, advantages=[s.token_advantages for s in data.samples], old_logps=[s.old for s in data.samples]
    )
    per_sample, clipped_low, clipped_high = [], 0, 0
    for s in data.samples:
        ratio = torch.exp(s.logps.detach() - torch.tensor(s.old, dtype=torch.float64))
        weight = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        per_sample.append(-weight * torch.tensor(s.token_advantages, dtype=torch.float64) * s.logps)
        clipped_low += int((ratio < 1 - epsilon).sum())
        clipped_high += int((ratio > 1 + epsilon_high).sum())
    _assert_same(result.loss, reference_reduce(per_sample, reduction), data)
    tokens = sum(len(s.old) for s in data.samples)
    assert result.metrics["clip_low_fraction"] == pytest.approx(clipped_low / tokens)
    assert result.metrics["clip_high_fraction"] == pytest.approx(clipped_high / tokens)


def test_importance_sampling_is_tinkers_sum(data, layout):
    inputs, outputs = data.batch(layout)
    got = ImportanceSamplingLoss()(
        inputs, outputs, advantages=[s.token_advantages for s in data.samples], old_logps=[s.old for s in data.samples]
    ).loss
    total = 0
    for s in data.samples:
        for t, advantage in enumerate(s.token_advantages):
            total = total - torch.exp(s.logps[t] - s.old[t]) * advantage
    _assert_same(got, total, data)


def test_dro_is_tinkers_quadratic_penalty(data, layout):
    inputs, outputs = data.batch(layout)
    got = DROLoss(beta=0.05)(
        inputs, outputs, advantages=[s.token_advantages for s in data.samples], old_logps=[s.old for s in data.samples]
    ).loss
    total = 0
    for s in data.samples:
        for t, advantage in enumerate(s.token_advantages):
            total = total - (s.logps[t] * advantage - 0.5 * 0.05 * (s.logps[t] - s.old[t]) ** 2)
    _assert_same(got, total, data)


def test_full_length_old_logps_with_junk_on_the_prompt_change_nothing(data, layout):
    """Values a sampler puts on prompt positions are ignored, however extreme (no overflowing ratio)."""
    inputs, outputs = data.batch(layout)
    advantages = [s.advantage for s in data.samples]
    completion = ImportanceSamplingLoss()(
        inputs, outputs, advantages=advantages, old_logps=[s.old for s in data.samples]
    )
    junk = [[-500.0] * s.prompt_len + s.old for s in data.samples]
    full = ImportanceSamplingLoss()(inputs, outputs, advantages=advantages, old_logps=junk)
    torch.testing.assert_close(full.loss, completion.loss)
    assert full.metrics == completion.metrics
