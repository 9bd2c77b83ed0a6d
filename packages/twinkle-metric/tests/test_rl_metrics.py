"""LogprobMismatchMetric, PolicyMetric and DPOMetric against direct numpy computations."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle.errors import InvalidInputError
from twinkle.metric import DPOMetric, LogprobMismatchMetric, PolicyMetric


def test_logprob_mismatch_on_ragged_masked_rows():
    rng = np.random.default_rng(0)
    lengths = [5, 1, 9]
    sampler = [rng.normal(size=n) - 2 for n in lengths]
    trainer = [row + rng.normal(scale=0.01, size=row.size) for row in sampler]
    masks = [rng.integers(0, 2, size=n) for n in lengths]
    masks[1][0] = 1
    metric = LogprobMismatchMetric()
    metric.accumulate(sampler_logps=[row.tolist() for row in sampler], trainer_logps=trainer, masks=masks)
    differences = np.concatenate([np.abs(t - s)[m == 1] for s, t, m in zip(sampler, trainer, masks, strict=True)])
    result = metric.calculate()
    assert result["logprob_mismatch/mean_abs"] == pytest.approx(differences.mean())
    assert result["logprob_mismatch/max_abs"] == pytest.approx(differences.max())
    assert result["logprob_mismatch/num_tokens"] == differences.size


def test_logprob_mismatch_accumulates_token_weighted_and_resets():
    metric = LogprobMismatchMetric()
    metric.accumulate(sampler_logps=[[-1.0, -2.0]], trainer_logps=[[-1.5, -2.0]])
    metric.accumulate(sampler_logps=[[-0.1]], trainer_logps=[[-0.3]])
    assert metric.calculate() == pytest.approx(
        {"logprob_mismatch/mean_abs": 0.7 / 3, "logprob_mismatch/max_abs": 0.5, "logprob_mismatch/num_tokens": 3.0}
    )
    metric.reset()
    assert metric.calculate() == {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sampler_logps": [[-1.0], None], "trainer_logps": [[-1.0], [-2.0]]}, r"sampler_logps\[1\] is None: sample"),
        ({"sampler_logps": [[-1.0]], "trainer_logps": [[-1.0], [-2.0]]}, "sampler_logps has 1 samples but trainer"),
        ({"sampler_logps": [[-1.0, -2.0]], "trainer_logps": [[-1.0]]}, r"sampler_logps\[0\] has 2 tokens but"),
        ({"sampler_logps": [[-1.0]], "trainer_logps": [[float("-inf")]]}, r"trainer_logps\[0\]\[0\] is -inf"),
        ({"sampler_logps": [[-1.0]], "trainer_logps": [[-1.0]], "masks": [[1, 1]]}, r"masks\[0\] has 2 entries"),
        ({"sampler_logps": [[-1.0]], "trainer_logps": [[-1.0]], "masks": [[0.5]]}, "must hold only 0 and 1"),
    ],
)
def test_logprob_mismatch_bad_inputs(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        LogprobMismatchMetric().accumulate(**kwargs)


def test_policy_metric_scalars_and_masked_tokens():
    metric = PolicyMetric()
    entropy = [[1.0, 2.0, 3.0], [4.0, 9.0]]
    masks = [[0, 1, 1], [1, 0]]
    metric.accumulate(clip_fraction=0.1, approx_kl=np.float32(0.02), entropy=entropy, masks=masks)
    metric.accumulate(clip_fraction=0.3, entropy=[[5.0]], masks=[[1]])
    result = metric.calculate()
    assert result["policy/clip_fraction"] == pytest.approx(0.2)
    assert result["policy/approx_kl"] == pytest.approx(0.02)
    assert result["policy/entropy"] == pytest.approx((2 + 3 + 4 + 5) / 4)  # token-weighted across calls
    metric.reset()
    assert metric.calculate() == {}


def test_policy_metric_flat_lists_and_tensors():
    torch = pytest.importorskip("torch")
    metric = PolicyMetric()
    metric.accumulate(ratio=torch.tensor([0.9, 1.1, 1.3]), approx_kl=torch.tensor(0.05))
    assert metric.calculate() == pytest.approx({"policy/ratio": 1.1, "policy/approx_kl": 0.05})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs at least one named value"),
        ({"approx_kl": float("nan")}, "approx_kl is nan"),
        ({"entropy": [[1.0], [2.0, float("inf")]]}, r"entropy\[1\]\[1\] is inf"),
        ({"entropy": [[1.0, 2.0]], "masks": [[1, 0], [1]]}, "masks has 2 rows but entropy has 1"),
        ({"entropy": "high"}, "entropy must be a list"),
    ],
)
def test_policy_metric_bad_inputs(kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        PolicyMetric().accumulate(**kwargs)


def test_dpo_metric():
    metric = DPOMetric()
    metric.accumulate(chosen_rewards=[0.5, -0.1, 0.2], rejected_rewards=[0.1, 0.3, 0.2])
    metric.accumulate(chosen_rewards=[1.0], rejected_rewards=[-1.0])
    chosen, rejected = np.array([0.5, -0.1, 0.2, 1.0]), np.array([0.1, 0.3, 0.2, -1.0])
    assert metric.calculate() == pytest.approx(
        {
            "dpo/accuracy": 0.5,  # the tie (0.2, 0.2) counts as wrong
            "dpo/margin": (chosen - rejected).mean(),
            "dpo/chosen_reward": chosen.mean(),
            "dpo/rejected_reward": rejected.mean(),
            "dpo/num_pairs": 4.0,
        }
    )
    metric.reset()
    assert metric.calculate() == {}
    with pytest.raises(InvalidInputError, match="chosen_rewards has 2 values but rejected_rewards has 1"):
        metric.accumulate(chosen_rewards=[1.0, 2.0], rejected_rewards=[0.0])
    with pytest.raises(InvalidInputError, match=r"rejected_rewards\[0\] is nan"):
        metric.accumulate(chosen_rewards=[1.0], rejected_rewards=[float("nan")])
