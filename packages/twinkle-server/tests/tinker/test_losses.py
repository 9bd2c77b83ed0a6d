"""Tinker's losses: value and gradient against the formulas written directly in torch, and every validation error."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from twinkle.data_format import ModelOutput
from twinkle.errors import InvalidInputError
from twinkle.loss import PPOLoss
from twinkle.server.tinker.codec import Datum
from twinkle.server.tinker.losses import LOSS_NAMES, build_loss, targets_of

# Tinker's defaults (tutorial: ppo 0.8/1.2, cispo 0/4) and the GSPO paper's.
DEFAULTS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (1 - 3e-4, 1 + 4e-4)}
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")


def make_case(
    name: str, lengths: tuple[int, ...] = (5, 9, 1, 4), k: int | None = None, weights: bool = True, seed: int = 0
) -> tuple[list[Datum], list[np.ndarray]]:
    """Datums for ``name`` and the trainer's log-probs (float64), with weights that are 0, fractional or negative."""
    rng = np.random.default_rng(seed)
    data, lps = [], []
    for n in lengths:
        shape = (n,) if k is None else (n, k)
        lp = -rng.exponential(1.0, shape)
        inputs = {"target_tokens": rng.integers(0, 100, shape)}
        if weights:
            inputs["weights"] = rng.choice([0.0, 0.25, 1.0, 1.5, -0.5], size=shape).astype(np.float32)
        if name != "cross_entropy":
            # A sampler near the trainer, so ratios land on both sides of every clip interval.
            inputs["logprobs"] = (lp + rng.normal(0.0, 0.3, shape)).astype(np.float32)
            inputs["advantages"] = rng.normal(0.0, 1.0, shape).astype(np.float32)
        if name == "gspo":
            inputs["sequence_ratio_mask"] = rng.choice([0.0, 1.0, 1.0, 0.5], size=shape).astype(np.float32)
        data.append(Datum(tokens=np.arange(n, dtype=np.int64), loss_fn_inputs=inputs))
        lps.append(lp)
    return data, lps


def tinker_loss(name: str, config: dict, data: list[Datum], lps: list[torch.Tensor]) -> torch.Tensor:
    """The formulas of tinker-protocol.md §3, one datum at a time, with nothing shared with the code under test."""
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if name in DEFAULTS:
        low = DEFAULTS[name][0] if low is None else low
        high = DEFAULTS[name][1] if high is None else high
    total = torch.zeros((), dtype=torch.float64)
    for datum, lp in zip(data, lps, strict=True):
        inputs = {key: torch.as_tensor(value, dtype=torch.float64) for key, value in datum.loss_fn_inputs.items()}
        w = inputs.get("weights", torch.ones_like(lp))
        if name == "cross_entropy":
            total = total - (lp * w).sum()
            continue
        q, a = inputs["logprobs"], inputs["advantages"]
        r = torch.exp(lp - q)
        if name == "importance_sampling":
            term = r * a
        elif name == "ppo":
            term = torch.min(r * a, torch.clamp(r, low, high) * a)
        elif name == "cispo":
            term = torch.clamp(r, low, high).detach() * lp * a
        elif name == "dro":
            term = lp * a - 0.5 * config["beta"] * (lp - q) ** 2
        else:
            m = inputs["sequence_ratio_mask"]
            s = torch.exp(((lp - q) * m).sum() / m.sum()) if m.sum() > 0 else torch.ones(())
            r_t = s.detach() * torch.exp(lp - lp.detach())
            term = torch.min(r_t * a, torch.clamp(r_t, low, high) * a)
        total = total - (w * term).sum()
    return total


def leaves(values: list[np.ndarray], dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [torch.tensor(value, dtype=dtype, requires_grad=True) for value in values]


def check_against_tinker(name: str, config: dict, data: list[Datum], values: list[np.ndarray]) -> dict[str, float]:
    lps, ref_lps = leaves(values), leaves(values)
    loss, metrics = build_loss(name, config, data)(lps)
    expected = tinker_loss(name, config, data, ref_lps)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for got, want in zip(lps, ref_lps, strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    assert metrics["loss:sum"] == pytest.approx(float(expected.detach()))
    assert all(re.fullmatch(r"[a-z_]+:(mean|sum|min|max)", key) for key in metrics), metrics
    return metrics


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("cross_entropy", {}),
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
        ("cispo", {}),
        ("cispo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
        ("dro", {"beta": 0.3}),
        ("dro", {"beta": 0}),
        ("gspo", {}),
        ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.25}),
    ],
)
@pytest.mark.parametrize("weights", [True, False])
def test_value_and_gradient_match_tinker(name: str, config: dict, weights: bool) -> None:
    data, values = make_case(name, weights=weights)
    metrics = check_against_tinker(name, config, data, values)
    if name != "cross_entropy":
        assert {"ratio:mean", "approx_kl:mean"} <= set(metrics)


def test_top_k_cross_entropy() -> None:
    data, values = make_case("cross_entropy", lengths=(3, 6), k=4)
    check_against_tinker("cross_entropy", {}, data, values)


def test_every_name_is_covered() -> None:
    assert set(LOSS_NAMES) == {"cross_entropy", *RL_LOSSES}


def test_defaults_are_tinkers() -> None:
    for name, (low, high) in DEFAULTS.items():
        data, values = make_case(name, seed=3)
        explicit = {"clip_low_threshold": low, "clip_high_threshold": high}
        default_loss, _ = build_loss(name, {}, data)(leaves(values))
        explicit_loss, _ = build_loss(name, explicit, data)(leaves(values))
        torch.testing.assert_close(default_loss, explicit_loss)
        other_loss, _ = build_loss(name, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, data)(leaves(values))
        assert not torch.allclose(default_loss, other_loss)


def test_ppo_metrics() -> None:
    data, values = make_case("ppo", seed=1)
    metrics = check_against_tinker("ppo", {}, data, values)
    ratios, low_hits, high_hits = [], [], []
    for datum, lp in zip(data, values, strict=True):
        inputs = datum.loss_fn_inputs
        trained = inputs["weights"] != 0
        r = np.exp(lp - inputs["logprobs"])[trained]
        a = inputs["advantages"][trained]
        ratios.append(r)
        low_hits.append((r < 0.8) & (a < 0))
        high_hits.append((r > 1.2) & (a > 0))
    assert metrics["ratio:mean"] == pytest.approx(np.concatenate(ratios).mean(), rel=1e-6)
    assert metrics["clip_low_fraction:mean"] == pytest.approx(np.concatenate(low_hits).mean())
    assert metrics["clip_high_fraction:mean"] == pytest.approx(np.concatenate(high_hits).mean())
    assert 0 < metrics["clip_high_fraction:mean"] < 1


def test_float32_and_bfloat16_logprobs() -> None:
    data, values = make_case("ppo")
    expected = tinker_loss("ppo", {}, data, leaves(values))
    for dtype in (torch.float32, torch.bfloat16):
        lps = leaves(values, dtype)
        loss, _ = build_loss("ppo", {}, data)(lps)
        assert loss.dtype == torch.float32  # bfloat16 is summed in float32
        loss.backward()
        assert all(lp.grad is not None and lp.grad.dtype == dtype for lp in lps)
        torch.testing.assert_close(loss.double(), expected, rtol=2e-2, atol=2e-2)


def test_untrained_tokens_with_a_far_off_sampler_stay_finite() -> None:
    # The formula as written would give inf · 0 = NaN on a weight-0 token whose q is far below lp.
    data, values = make_case("importance_sampling", lengths=(6,))
    inputs = data[0].loss_fn_inputs
    inputs["weights"][:2] = 0.0
    inputs["logprobs"][:2] = -500.0
    lps = leaves(values, torch.float32)
    loss, _ = build_loss("importance_sampling", {}, data)(lps)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lps[0].grad).all()
    assert (lps[0].grad[:2] == 0).all()
    inputs["logprobs"][:2] = values[0][:2]  # any finite q there gives the same loss
    reference = tinker_loss("importance_sampling", {}, data, leaves(values))
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-5)


def test_forward_backward_custom_surrogate() -> None:
    """The SDK's forward_backward_custom: cross_entropy with w = −dC/dlp must have C's gradient."""
    data, values = make_case("cross_entropy", lengths=(4, 7), weights=False)
    zero = [Datum(d.tokens, {**d.loss_fn_inputs, "weights": np.zeros(len(d.tokens), np.float32)}) for d in data]
    loss, metrics = build_loss("cross_entropy", {}, zero)(leaves(values))  # its forward pass: all weights 0
    assert float(loss.detach()) == 0.0 and metrics == {"loss:sum": 0.0}
    custom = leaves(values)
    (torch.stack([(lp**2).sum() for lp in custom]).sum()).backward()
    surrogate = [
        Datum(d.tokens, {**d.loss_fn_inputs, "weights": (-lp.grad).numpy().astype(np.float32)})
        for d, lp in zip(data, custom, strict=True)
    ]
    lps = leaves(values)
    build_loss("cross_entropy", {}, surrogate)(lps)[0].backward()
    for got, want in zip(lps, custom, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-6)


def test_twinkle_ppo_call_agrees_for_non_negative_weights() -> None:
    """The twinkle class through its own ``__call__`` (padded [B, T]) matches where its conventions coincide."""
    data, values = make_case("ppo", lengths=(5, 3), seed=2)
    for datum in data:
        datum.loss_fn_inputs["weights"] = np.abs(datum.loss_fn_inputs["weights"])
    width = max(len(d.tokens) for d in data)

    def padded(rows: list[np.ndarray]) -> torch.Tensor:
        return torch.tensor(np.stack([np.pad(row, (0, width - len(row))) for row in rows]), dtype=torch.float64)

    lp_BT = padded(values).requires_grad_(True)
    twinkle = PPOLoss(epsilon=0.2, epsilon_high=0.2, reduction="token_sum")(
        {"loss_weights": padded([d.loss_fn_inputs["weights"] for d in data])},
        ModelOutput(logps=lp_BT),
        normalizer=1.0,
        advantages=[padded([d.loss_fn_inputs["advantages"]])[0] for d in data],
        old_logps=[padded([d.loss_fn_inputs["logprobs"]])[0] for d in data],
    )
    ours, _ = build_loss("ppo", {}, data)(leaves(values))
    torch.testing.assert_close(twinkle.loss, ours)


def _drop(key: str) -> Callable[[list[Datum]], None]:
    return lambda data: data[1].loss_fn_inputs.pop(key)


def _put(key: str, value: Callable[[tuple[int, ...]], np.ndarray]) -> Callable[[list[Datum]], None]:
    def mutate(data: list[Datum]) -> None:
        data[1].loss_fn_inputs[key] = value(data[1].loss_fn_inputs["target_tokens"].shape)

    return mutate


def _poison(key: str, bad: float) -> Callable[[list[Datum]], None]:
    def mutate(data: list[Datum]) -> None:
        data[1].loss_fn_inputs[key][3] = bad

    return mutate


def _nothing(data: list[Datum]) -> None:
    return None


@pytest.mark.parametrize(
    ("name", "config", "mutate", "message"),
    [
        ("nope", {}, _nothing, "unknown loss_fn 'nope'; this server supports cross_entropy, importance_sampling"),
        ("stable_reinforce", {}, _nothing, "'stable_reinforce' is not supported by this server: its algorithm"),
        ("custom", {}, _nothing, "'custom' is not supported by this server: server-side custom losses are off; use "),
        ("ppo", {"beta": 0.1}, _nothing, "loss_fn_config: ppo has no parameter 'beta'; it takes clip_low_threshold"),
        ("cross_entropy", {"clip_low_threshold": 0.5}, _nothing, "cross_entropy has no parameter 'clip_low_threshold'"),
        ("ppo", {"clip_low_threshold": "0.8"}, _nothing, "loss_fn_config['clip_low_threshold']: must be a finite"),
        ("ppo", {"clip_high_threshold": float("nan")}, _nothing, "loss_fn_config['clip_high_threshold']: must be a"),
        ("dro", {"beta": True}, _nothing, "loss_fn_config['beta']: must be a finite number, got True"),
        ("dro", {}, _nothing, "loss_fn_config: dro needs 'beta'"),
        ("dro", {"beta": -1.0}, _nothing, "loss_fn_config['beta']: must be >= 0"),
        ("ppo", {"clip_low_threshold": 1.3}, _nothing, "clip_low_threshold (1.3) is above clip_high_threshold (1.2)"),
        ("cispo", {"clip_low_threshold": -0.1}, _nothing, "['clip_low_threshold']: must be in [0, 1], got -0.1"),
        ("gspo", {"clip_high_threshold": 0.99, "clip_low_threshold": 0.9}, _nothing, "must be >= 1, got 0.99"),
        ("ppo", {}, _drop("target_tokens"), "data[1].loss_fn_inputs: ppo needs 'target_tokens'"),
        ("ppo", {}, _drop("logprobs"), "data[1].loss_fn_inputs: ppo needs 'logprobs'"),
        ("dro", {"beta": 1.0}, _drop("advantages"), "data[1].loss_fn_inputs: dro needs 'advantages'"),
        ("gspo", {}, _drop("sequence_ratio_mask"), "data[1].loss_fn_inputs: gspo needs 'sequence_ratio_mask'"),
        ("ppo", {}, _put("mask", np.ones), "data[1].loss_fn_inputs: ppo does not take 'mask'; it takes target_tokens"),
        ("ppo", {}, _put("clip_low_threshold", np.ones), "(clip thresholds go in loss_fn_config)"),
        ("cross_entropy", {}, _put("advantages", np.ones), "cross_entropy does not take 'advantages'"),
        ("ppo", {}, _put("target_tokens", np.ones), "data[1].loss_fn_inputs['target_tokens']: must be integer"),
        (
            "ppo",
            {},
            _put("target_tokens", lambda s: np.ones((*s, 1, 1), np.int64)),
            "['target_tokens']: must have shape [N] or [N, K], got [9, 1, 1]",
        ),
        (
            "ppo",
            {},
            _put("target_tokens", lambda s: np.ones(8, np.int64)),
            "data[1].loss_fn_inputs['target_tokens']: has 8 positions but model_input has 9 tokens",
        ),
        ("ppo", {}, _put("target_tokens", lambda s: np.ones((9, 0), np.int64)), "has K = 0 targets per position"),
        ("ppo", {}, _put("target_tokens", lambda s: -np.ones(s, np.int64)), "holds the negative token id -1"),
        (
            "ppo",
            {},
            _put("weights", lambda s: np.ones(8, np.float32)),
            "data[1].loss_fn_inputs['weights']: has shape [8] but target_tokens has [9]",
        ),
        ("ppo", {}, _put("weights", lambda s: np.ones(s, bool)), "['weights']: must be numbers (float32), got bool"),
        (
            "ppo",
            {},
            _poison("weights", float("inf")),
            "data[1].loss_fn_inputs['weights']: holds inf at flat position 3",
        ),
        ("ppo", {}, _poison("advantages", float("nan")), "data[1].loss_fn_inputs['advantages']: holds nan"),
        ("ppo", {}, _poison("logprobs", float("-inf")), "data[1].loss_fn_inputs['logprobs']: holds -inf"),
        ("gspo", {}, _poison("sequence_ratio_mask", -1.0), "['sequence_ratio_mask']: must be >= 0"),
    ],
)
def test_validation_errors(name: str, config: dict, mutate: Callable[[list[Datum]], None], message: str) -> None:
    data, _ = make_case(name if name in LOSS_NAMES else "gspo")
    mutate(data)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        build_loss(name, config, data)


def test_int64_weights_and_advantages_are_accepted() -> None:
    data, values = make_case("importance_sampling", lengths=(3,))
    data[0].loss_fn_inputs["weights"] = np.array([1, 0, 2], dtype=np.int64)
    data[0].loss_fn_inputs["advantages"] = np.array([1, -1, 3], dtype=np.int64)
    check_against_tinker("importance_sampling", {}, data, values)


def test_empty_data_and_targets_of() -> None:
    with pytest.raises(InvalidInputError, match="data is empty"):
        build_loss("cross_entropy", {}, [])
    data, _ = make_case("cross_entropy", lengths=(3,), k=2)
    assert targets_of(data[0], 0).shape == (3, 2) and targets_of(data[0], 0).dtype == np.int64


def test_closure_checks_the_trainer_logprobs() -> None:
    data, values = make_case("cross_entropy", lengths=(3, 4))
    loss_fn = build_loss("cross_entropy", {}, data)
    with pytest.raises(ValueError, match="log-probs for 1 datums, the request has 2"):
        loss_fn(leaves(values[:1]))
    with pytest.raises(ValueError, match=re.escape("log-probs of datum 1 have shape [3], its targets [4]")):
        loss_fn(leaves([values[0], values[1][:3]]))
