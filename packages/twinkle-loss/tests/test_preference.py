"""DPO variants and SimPO against per-pair references from their papers; the pair layout and its errors."""

import pytest
import torch

from twinkle.data_format import ModelOutput
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.loss import DPOLoss, SimPOLoss


def _assert_same(got, expected, data):
    torch.testing.assert_close(got, expected)
    got_grads = torch.autograd.grad(got, data.leaves)
    for grad, expected_grad in zip(got_grads, torch.autograd.grad(expected, data.leaves), strict=True):
        torch.testing.assert_close(grad, expected_grad)


def _dpo_reference(data, beta, loss_type, label_smoothing=0.0, reference_free=False):
    """Mean over pairs of the DPO/IPO/hinge loss, and the implicit rewards, one pair at a time."""
    losses, chosen_rewards, rejected_rewards = [], [], []
    n = len(data.samples) // 2
    for chosen, rejected in zip(data.samples[:n], data.samples[n:], strict=True):
        sides = []
        for s in (chosen, rejected):
            policy, ref = s.logps.sum(), 0.0 if reference_free else sum(s.ref)
            if loss_type == "ipo":  # IPO compares per-token means
                policy, ref = policy / len(s.old), ref / len(s.old)
            sides.append(policy - ref)
        h = sides[0] - sides[1]
        if loss_type == "sigmoid":
            loss = -(1 - label_smoothing) * torch.log(torch.sigmoid(beta * h)) - label_smoothing * torch.log(
                torch.sigmoid(-beta * h)
            )
        elif loss_type == "ipo":
            loss = (h - 1 / (2 * beta)) ** 2
        else:
            loss = torch.clamp(1 - beta * h, min=0)
        losses.append(loss)
        chosen_rewards.append(beta * float(sides[0].detach()))
        rejected_rewards.append(beta * float(sides[1].detach()))
    return torch.stack(losses).mean(), chosen_rewards, rejected_rewards


@pytest.mark.parametrize(
    ("beta", "loss_type", "label_smoothing"),
    [(0.1, "sigmoid", 0.0), (0.5, "sigmoid", 0.2), (0.1, "ipo", 0.0), (0.7, "hinge", 0.0)],
)
def test_dpo_matches_the_papers(pair_data, layout, beta, loss_type, label_smoothing):
    inputs, outputs = pair_data.batch(layout)
    loss = DPOLoss(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
    result = loss(inputs, outputs, ref_logps=[s.ref for s in pair_data.samples])
    expected, chosen, rejected = _dpo_reference(pair_data, beta, loss_type, label_smoothing)
    _assert_same(result.loss, expected, pair_data)
    assert result.metrics["chosen_reward"] == pytest.approx(sum(chosen) / 3)
    assert result.metrics["rejected_reward"] == pytest.approx(sum(rejected) / 3)
    assert result.metrics["margin"] == pytest.approx((sum(chosen) - sum(rejected)) / 3)
    assert result.metrics["accuracy"] == pytest.approx(sum(c > r for c, r in zip(chosen, rejected, strict=True)) / 3)
    assert result.num_tokens == sum(len(s.old) for s in pair_data.samples)


def test_reference_log_probs_in_every_form_agree(pair_data, layout):
    inputs, outputs = pair_data.batch(layout)
    forms = [
        [sum(s.ref) for s in pair_data.samples],
        [s.ref for s in pair_data.samples],
        [s.full(s.ref) for s in pair_data.samples],
        torch.tensor([sum(s.ref) for s in pair_data.samples]),
    ]
    losses = [DPOLoss()(inputs, outputs, ref_logps=ref).loss for ref in forms]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0])


def test_reference_free_dpo_uses_a_zero_reference(pair_data):
    inputs, outputs = pair_data.batch("packed")
    got = DPOLoss(beta=0.2, reference_free=True)(inputs, outputs).loss
    _assert_same(got, _dpo_reference(pair_data, 0.2, "sigmoid", reference_free=True)[0], pair_data)


def test_simpo_matches_the_paper(pair_data, layout):
    inputs, outputs = pair_data.batch(layout)
    result = SimPOLoss(beta=2.0, gamma=0.5)(inputs, outputs)
    losses, chosen, rejected = [], [], []
    for c, r in zip(pair_data.samples[:3], pair_data.samples[3:], strict=True):
        reward_c, reward_r = 2.0 * c.logps.sum() / len(c.old), 2.0 * r.logps.sum() / len(r.old)
        losses.append(-torch.log(torch.sigmoid(reward_c - reward_r - 0.5)))
        chosen.append(float(reward_c.detach()))
        rejected.append(float(reward_r.detach()))
    _assert_same(result.loss, torch.stack(losses).mean(), pair_data)
    assert result.metrics["chosen_reward"] == pytest.approx(sum(chosen) / 3)
    assert result.metrics["margin"] == pytest.approx((sum(chosen) - sum(rejected)) / 3)


def test_the_whole_batch_normalizer_is_the_number_of_pairs(pair_data):
    inputs, outputs = pair_data.batch("right")
    loss = DPOLoss()
    ref = [s.ref for s in pair_data.samples]
    assert loss.normalizer(inputs) == 3.0
    torch.testing.assert_close(
        loss(inputs, outputs, normalizer=3.0, ref_logps=ref).loss, loss(inputs, outputs, ref_logps=ref).loss
    )


def test_a_global_normalizer_gives_this_calls_share_of_the_global_mean(pair_data):
    """Under data parallelism a rank holds whole pairs and divides by the global batch's number of pairs."""
    inputs, outputs = pair_data.batch("right")
    assert SimPOLoss.pairwise and DPOLoss.pairwise  # models keep their calls whole (no micro-batches)
    torch.testing.assert_close(SimPOLoss()(inputs, outputs, normalizer=6.0).loss, SimPOLoss()(inputs, outputs).loss / 2)
    with pytest.raises(InvalidInputError, match=r"normalizer=2 for a call with 3 pairs: .* whole \(global\) batch"):
        SimPOLoss()(inputs, outputs, normalizer=2.0)


@pytest.mark.parametrize("layout_name", ["right", "packed"])
def test_an_odd_number_of_sequences_is_refused(pair_data, layout_name):
    inputs, outputs = pair_data.batch(layout_name, [0, 1, 3])
    with pytest.raises(InvalidInputError, match=r"needs an even number of sequences .* got 3"):
        DPOLoss()(inputs, outputs, ref_logps=[0.0] * 3)
    with pytest.raises(InvalidInputError, match="got 3"):
        SimPOLoss().normalizer(inputs)


def test_input_errors(pair_data):
    inputs, outputs = pair_data.batch("right")
    ref = [s.ref for s in pair_data.samples]
    with pytest.raises(InvalidInputError, match="DPOLoss needs ref_logps"):
        DPOLoss()(inputs, outputs)
    with pytest.raises(InvalidInputError, match=r"reference_free=True\) takes no ref_logps"):
        DPOLoss(reference_free=True)(inputs, outputs, ref_logps=ref)
    with pytest.raises(InvalidInputError, match=r"SimPOLoss got unknown inputs \['ref_logps'\]"):
        SimPOLoss()(inputs, outputs, ref_logps=ref)
    with pytest.raises(InvalidInputError, match=r"ref_logps\[2\] has 2 values, but sample 2 has 1 supervised"):
        DPOLoss()(inputs, outputs, ref_logps=[*ref[:2], [-1.0, -1.0], *ref[3:]])
    with pytest.raises(InvalidInputError, match="DPOLoss needs per-token logps"):
        DPOLoss()(inputs, ModelOutput(), ref_logps=ref)
    empty = {**inputs, "loss_mask": inputs["loss_mask"].clone()}
    empty["loss_mask"][4] = 0
    with pytest.raises(InvalidInputError, match="sequence 4 has no trained token"):
        SimPOLoss()(empty, outputs)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DPOLoss(loss_type="kto"), "unknown DPO loss_type 'kto'"),
        (lambda: DPOLoss(beta=0.0), "beta must be a finite number > 0"),
        (lambda: DPOLoss(label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
        (lambda: DPOLoss(loss_type="ipo", label_smoothing=0.1), "label_smoothing applies to loss_type='sigmoid' only"),
        (lambda: SimPOLoss(beta=-2.0), "beta must be a finite number > 0"),
        (lambda: SimPOLoss(gamma=float("nan")), "gamma must be a finite number"),
    ],
)
def test_bad_configuration(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()
