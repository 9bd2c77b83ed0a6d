"""Token-level losses: micro-batch losses under the whole batch's normalizer add up to the whole batch's loss."""

import pytest
import torch

from twinkle.loss import CISPOLoss, DRGRPOLoss, DROLoss, GRPOLoss, GSPOLoss, ImportanceSamplingLoss, PPOLoss

LOSSES = {
    "grpo_token_mean": lambda: GRPOLoss(epsilon=0.2, beta=0.04),
    "grpo_sequence_mean": lambda: GRPOLoss(reduction="sequence_mean"),
    "ppo_token_sum": lambda: PPOLoss(epsilon=0.2, epsilon_high=0.3, reduction="token_sum"),
    "dr_grpo": lambda: DRGRPOLoss(max_length=6, beta=0.04),
    "gspo": lambda: GSPOLoss(epsilon=0.1, beta=0.04),
    "gspo_token_mean": lambda: GSPOLoss(reduction="token_mean"),
    "cispo": lambda: CISPOLoss(epsilon=0.2, epsilon_high=0.2),
    "importance_sampling": lambda: ImportanceSamplingLoss(),
    "importance_sampling_token_mean": lambda: ImportanceSamplingLoss("token_mean"),
    "dro": lambda: DROLoss(beta=0.1),
}


def _call(loss, data, layout, indices, normalizer=None):
    inputs, outputs = data.batch(layout, indices)
    samples = [data.samples[i] for i in indices]
    kwargs = {
        "advantages": [s.token_advantages for s in samples],
        "old_logps": [s.old for s in samples],
    }
    if getattr(loss, "kl_coef", None):
        kwargs["ref_logps"] = [s.full(s.ref) for s in samples]
    return loss(inputs, outputs, normalizer=normalizer, **kwargs)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("split", [[[0, 1], [2, 3]], [[0], [1, 2, 3]], [[0], [1], [2], [3]]])
def test_micro_batches_sum_to_the_whole_batch(data, layout, name, split):
    loss = LOSSES[name]()
    whole = _call(loss, data, layout, [0, 1, 2, 3])
    normalizer = loss.normalizer(data.batch(layout)[0])
    parts = [_call(loss, data, layout, indices, normalizer) for indices in split]
    total = sum(part.loss for part in parts)
    torch.testing.assert_close(total, whole.loss)
    grads = torch.autograd.grad(total, data.leaves)
    for grad, expected in zip(grads, torch.autograd.grad(whole.loss, data.leaves), strict=True):
        torch.testing.assert_close(grad, expected)
    assert sum(part.num_tokens for part in parts) == whole.num_tokens == sum(len(s.old) for s in data.samples)
