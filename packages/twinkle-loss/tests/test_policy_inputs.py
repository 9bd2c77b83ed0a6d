"""Policy losses: what they accept, what they refuse (with messages naming the input), and how they resolve by name."""

import numpy as np
import pytest
import torch

from twinkle.data_format import ModelOutput
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.loss import (
    CISPOLoss,
    ConstantLengthReduction,
    CrossEntropyLoss,
    DPOLoss,
    DRGRPOLoss,
    DROLoss,
    GRPOLoss,
    GSPOLoss,
    ImportanceSamplingLoss,
    PPOLoss,
    SimPOLoss,
)
from twinkle.registry import build

ALIASES = {
    "cross_entropy": CrossEntropyLoss,
    "grpo": GRPOLoss,
    "ppo": PPOLoss,
    "dr_grpo": DRGRPOLoss,
    "gspo": GSPOLoss,
    "importance_sampling": ImportanceSamplingLoss,
    "cispo": CISPOLoss,
    "dro": DROLoss,
    "dpo": DPOLoss,
    "simpo": SimPOLoss,
}
REQUIRED = {DRGRPOLoss: {"max_length": 16}, DROLoss: {"beta": 0.1}}


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_every_loss_resolves_by_class_name_and_alias(alias):
    cls = ALIASES[alias]
    kwargs = REQUIRED.get(cls, {})
    assert type(build("loss", alias, **kwargs)) is cls
    assert type(build("loss", cls.__name__, **kwargs)) is cls


def test_tinker_loss_fn_config_maps_onto_the_parameters():
    ppo = build("loss", "ppo", epsilon=1 - 0.8, epsilon_high=1.2 - 1, reduction="token_sum")
    assert (ppo.clip_low, ppo.clip_high) == pytest.approx((0.8, 1.2))
    cispo = build("loss", "cispo")
    assert (cispo.clip_low, cispo.clip_high) == (0.0, 4.0)
    assert build("loss", "dro", beta=0.05).beta == 0.05


def test_missing_and_unknown_inputs(data):
    inputs, outputs = data.batch()
    advantages = [s.advantage for s in data.samples]
    with pytest.raises(InvalidInputError, match=r"GRPOLoss needs advantages=\[\.\.\.\]"):
        GRPOLoss()(inputs, outputs)
    with pytest.raises(InvalidInputError, match=r"got unknown inputs \['rewards'\]"):
        GRPOLoss()(inputs, outputs, advantages=advantages, rewards=[1.0] * 4)
    with pytest.raises(InvalidInputError, match="GSPOLoss needs per-token logps"):
        GSPOLoss()(inputs, ModelOutput(), advantages=advantages)
    with pytest.raises(
        InvalidInputError, match=r"outputs.logps has shape \(4, 7\) but the batch's tokens are \(4, 8\)"
    ):
        GRPOLoss()(inputs, ModelOutput(logps=outputs.logps[:, :-1]), advantages=advantages)


def test_ref_logps_go_with_a_positive_beta_only(data):
    inputs, outputs = data.batch()
    advantages, ref = [s.advantage for s in data.samples], [s.ref for s in data.samples]
    with pytest.raises(InvalidInputError, match=r"GRPOLoss has beta=0.1 > 0 and needs ref_logps"):
        GRPOLoss(beta=0.1)(inputs, outputs, advantages=advantages)
    with pytest.raises(InvalidInputError, match="GRPOLoss got ref_logps but has beta=0; set beta > 0"):
        GRPOLoss()(inputs, outputs, advantages=advantages, ref_logps=ref)
    with pytest.raises(InvalidInputError, match="CISPOLoss got ref_logps but has no KL term"):
        CISPOLoss()(inputs, outputs, advantages=advantages, ref_logps=ref)


def test_bad_old_logps_name_the_sample(data):
    inputs, outputs = data.batch("packed")
    old = [s.old for s in data.samples]
    old[3] = [*old[3][:-1], float("nan")]
    with pytest.raises(InvalidInputError, match=r"old_logps\[3\] holds nan at position 4"):
        PPOLoss()(inputs, outputs, advantages=[0.0] * 4, old_logps=old)
    with pytest.raises(InvalidInputError, match=r"old_logps\[0\] has 3 values, but sample 0 has 4 supervised tokens"):
        PPOLoss()(inputs, outputs, advantages=[0.0] * 4, old_logps=[s.old[:3] for s in data.samples])


@pytest.mark.parametrize("scalar", [torch.tensor(0.5), np.array(0.5)], ids=["tensor", "ndarray"])
def test_a_0d_array_of_advantages_is_not_one_per_sample(data, scalar):
    inputs, outputs = data.batch()
    with pytest.raises(
        InvalidInputError, match=rf"advantages must have one entry per sample \(4\), got a 0-d {type(scalar).__name__}"
    ):
        GRPOLoss()(inputs, outputs, advantages=scalar)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: GRPOLoss(epsilon=1.5), r"epsilon must be in \[0, 1\]"),
        (lambda: GRPOLoss(epsilon=-0.1), r"epsilon must be in \[0, 1\]"),
        (lambda: PPOLoss(epsilon_high=float("inf")), "epsilon_high must be a finite number >= 0"),
        (lambda: GRPOLoss(beta=-1.0), "beta must be a finite number >= 0"),
        (lambda: GRPOLoss(reduction="mean"), "unknown reduction 'mean'"),
        (lambda: GRPOLoss(reduction=object()), "or an object with normalizer"),
        (lambda: DRGRPOLoss(max_length=0), "max_length must be a positive int"),
        (lambda: DROLoss(beta=float("nan")), "beta must be a finite number >= 0"),
        (lambda: build("loss", "dro"), "cannot build loss DROLoss"),
    ],
)
def test_bad_configuration(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_dr_grpo_refuses_completions_longer_than_its_budget(data):
    inputs, outputs = data.batch()
    with pytest.raises(InvalidInputError, match="sequence 1 trains 6 tokens, more than max_length=5"):
        DRGRPOLoss(max_length=5)(inputs, outputs, advantages=[0.0] * 4)


def test_a_custom_reducer_plugs_in(data):
    inputs, outputs = data.batch()
    advantages = [s.advantage for s in data.samples]
    custom = GRPOLoss(reduction=ConstantLengthReduction(8))(inputs, outputs, advantages=advantages).loss
    torch.testing.assert_close(custom, DRGRPOLoss(max_length=8)(inputs, outputs, advantages=advantages).loss)


def test_float_loss_weights_scale_tokens(data):
    inputs, outputs = data.batch("right")
    weights_BT = inputs["loss_mask"] * torch.linspace(0.1, 1.0, inputs["loss_mask"].shape[1])
    advantages = [s.token_advantages for s in data.samples]
    got = ImportanceSamplingLoss()({**inputs, "loss_weights": weights_BT}, outputs, advantages=advantages).loss
    expected = 0.0
    for row, s in enumerate(data.samples):  # on-policy, so every ratio is 1
        completion = inputs["loss_mask"][row].nonzero().flatten()
        expected -= float((torch.tensor(s.token_advantages) * weights_BT[row, completion]).sum())
    assert got.item() == pytest.approx(expected)
