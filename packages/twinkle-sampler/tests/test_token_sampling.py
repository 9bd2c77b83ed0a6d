"""The next-token rules on small synthetic distributions, against exact expectations."""

import pytest
import torch

from twinkle.data_format import SamplingParams
from twinkle.module import token_logps_from_logits
from twinkle.sampler.token_sampling import TOP_P_CANDIDATES, apply_repetition_penalty, choose_tokens, draw

LOGITS_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 40_000


def _frequencies(params, logits_V=LOGITS_V, seed=0):
    logits_BV = logits_V.expand(DRAWS, -1)
    tokens = choose_tokens(logits_BV, params, torch.Generator().manual_seed(seed)).tokens_B
    return torch.bincount(tokens, minlength=logits_V.numel()).double() / DRAWS


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_unfiltered_draws_follow_softmax_at_temperature(temperature):
    expected = torch.softmax(LOGITS_V.double() / temperature, dim=-1)
    frequencies = _frequencies(SamplingParams(temperature=temperature, logprobs=False))
    assert (frequencies - expected).abs().max() < 0.01


def test_top_k_draws_only_the_k_best_renormalised():
    frequencies = _frequencies(SamplingParams(top_k=2))
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:2] = torch.softmax(LOGITS_V[:2].double(), dim=-1)
    assert frequencies[2:].sum() == 0
    assert (frequencies - expected).abs().max() < 0.01


def test_top_p_keeps_tokens_whose_more_likely_predecessors_hold_less_than_p():
    probs = torch.softmax(LOGITS_V.double(), dim=-1)  # ≈ [.55, .20, .12, .07, .03, .003]
    top_p = float(probs[:2].sum()) + 0.01  # the first two hold less than p, so the third is kept too
    frequencies = _frequencies(SamplingParams(top_p=top_p))
    expected = torch.zeros(6, dtype=torch.float64)
    expected[:3] = probs[:3] / probs[:3].sum()
    assert frequencies[3:].sum() == 0
    assert (frequencies - expected).abs().max() < 0.01


def test_rows_with_a_nucleus_wider_than_the_candidates_are_sorted_in_full():
    vocab = 4 * TOP_P_CANDIDATES
    peaked_V = torch.full((vocab,), -20.0)
    peaked_V[:3] = torch.tensor([3.0, 2.0, 1.0])
    flat_V = torch.linspace(0.0, 0.01, vocab)  # a nucleus of 0.9 spans 90% of the vocabulary
    logits_BV = torch.stack([peaked_V, flat_V]).repeat(2000, 1)
    tokens_B = choose_tokens(logits_BV, SamplingParams(top_p=0.9), torch.Generator().manual_seed(1)).tokens_B
    peaked, flat = tokens_B[0::2], tokens_B[1::2]
    assert set(peaked.tolist()) == {0, 1}, "0.67 + 0.24 reaches 0.9 after two tokens"
    assert flat.unique().numel() > 2 * TOP_P_CANDIDATES
    assert flat.min() >= int(0.1 * vocab) - 8, "the least likely tenth is cut"


def test_top_k_then_top_p_and_greedy():
    frequencies = _frequencies(SamplingParams(top_k=3, top_p=0.5))
    assert frequencies[0] == 1.0, "the best token alone holds over half of the top-3 mass"
    greedy = choose_tokens(
        torch.randn(5, 50, generator=torch.Generator().manual_seed(0)), SamplingParams(temperature=0), None
    )
    assert torch.equal(greedy.tokens_B, torch.randn(5, 50, generator=torch.Generator().manual_seed(0)).argmax(-1))


def test_a_seeded_generator_makes_draws_repeatable():
    logits_BV = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.8, top_p=0.95)
    first = choose_tokens(logits_BV, params, torch.Generator().manual_seed(7)).tokens_B
    again = choose_tokens(logits_BV, params, torch.Generator().manual_seed(7)).tokens_B
    other = choose_tokens(logits_BV, params, torch.Generator().manual_seed(8)).tokens_B
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_zero_weights_are_never_drawn():
    weights_BN = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0], [1e-30, 0.0, 1.0, 0.0]]).repeat(3000, 1)
    picks = draw(weights_BN, torch.Generator().manual_seed(0)).view(3000, 3)
    assert (picks[:, 0] == 1).all() and (picks[:, 1] == 3).all() and set(picks[:, 2].tolist()) <= {0, 2}


def test_logprobs_are_raw_and_topk_is_sorted():
    logits_BV = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=0.3, top_k=5, logprobs=4, repetition_penalty=1.5)
    step = choose_tokens(logits_BV, params, torch.Generator().manual_seed(0), seen_ids_BS=torch.zeros(4, 1).long())
    torch.testing.assert_close(step.logprobs_B, token_logps_from_logits(logits_BV, step.tokens_B), atol=1e-6, rtol=0)
    expected_top = torch.log_softmax(logits_BV.double(), dim=-1).topk(4)
    assert torch.equal(step.topk_ids_BK, expected_top.indices)
    torch.testing.assert_close(step.topk_logprobs_BK.double(), expected_top.values, atol=1e-5, rtol=0)
    assert choose_tokens(logits_BV, SamplingParams(logprobs=False), None).logprobs_B is None


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits_BV = torch.randn(2, 20, generator=torch.Generator().manual_seed(0))
    seen_BS = torch.tensor([[1, 4, 4, 7], [0, 0, 19, 2]])
    expected = RepetitionPenaltyLogitsProcessor(1.7)(seen_BS, logits_BV.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits_BV, seen_BS, 1.7), expected)
