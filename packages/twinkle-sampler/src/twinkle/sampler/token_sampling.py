"""Choosing every row's next token from ``[B, V]`` logits, cheaply over a 151k-token vocabulary.

Per decode step the costly parts of sampling are passes over ``B × V``
elements, and above all random numbers: drawing one per vocabulary entry
(Gumbel-max, ``torch.multinomial``) costs more than the model's own output
layer on a CPU. Here a random draw is one uniform number per row, turned into
a token by inverse-CDF search over the (unnormalised) probabilities:

- no filter (``top_k=-1, top_p=1``): ``softmax(logits / T)``, a cumulative sum, a binary search;
- ``top_k``: the same over the ``k`` best logits only;
- ``top_p``: the nucleus of a trained model almost always lies within its best few
  hundred tokens, so it is searched there (``topk``); only rows whose nucleus is
  wider are sorted in full.

The filters follow vLLM and transformers: temperature, then top-k, then
top-p over the renormalised top-k distribution, keeping every token whose
preceding (more likely) tokens hold less than ``top_p`` of the mass.

Log-probabilities are always those of the *raw* logits (the model's own
distribution at temperature 1, before penalties and filters): they are what a
trainer computes for the same tokens, so importance ratios start at exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from twinkle.data_format import SamplingParams

# Candidates searched for the nucleus before falling back to a full sort.
TOP_P_CANDIDATES = 512


@dataclass
class StepTokens:
    """One decode step: ``tokens_B``, their raw log-probs and, when asked, the top-k alternatives."""

    tokens_B: torch.Tensor
    logprobs_B: torch.Tensor | None = None
    topk_ids_BK: torch.Tensor | None = None
    topk_logprobs_BK: torch.Tensor | None = None


def choose_tokens(
    logits_BV: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    seen_ids_BS: torch.Tensor | None = None,
) -> StepTokens:
    """Pick the next token of every row; ``seen_ids_BS`` (tokens so far) feeds the repetition penalty."""
    logits_BV = logits_BV.float()
    scores_BV = logits_BV
    if params.repetition_penalty != 1.0 and seen_ids_BS is not None:
        scores_BV = apply_repetition_penalty(logits_BV, seen_ids_BS, params.repetition_penalty)
    if not requested(params.logprobs):
        return StepTokens(_pick(scores_BV, params, generator))
    exp_BV, logsumexp_B1 = exp_and_logsumexp(logits_BV)
    reusable = exp_BV if scores_BV is logits_BV and params.temperature == 1.0 else None
    step = StepTokens(_pick(scores_BV, params, generator, reusable))
    step.logprobs_B = logits_BV.gather(-1, step.tokens_B.unsqueeze(-1)).squeeze(-1) - logsumexp_B1.squeeze(-1)
    k = topk_count(params.logprobs)
    if k:
        values_BK, step.topk_ids_BK = logits_BV.topk(min(k, logits_BV.shape[-1]), dim=-1)
        step.topk_logprobs_BK = values_BK - logsumexp_B1
    return step


def exp_and_logsumexp(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(logits - max)`` (unnormalised probabilities) and ``logsumexp(logits)`` per row.

    The sum is ``torch.sum``'s, as in ``torch.logsumexp`` which the trainer
    uses: ``torch.log_softmax`` accumulates less accurately over a 151k vocabulary
    (errors near 1e-4), which would break sampler/trainer log-prob parity.
    """
    max_B1 = logits_BV.amax(dim=-1, keepdim=True)
    exp_BV = (logits_BV - max_B1).exp_()
    return exp_BV, exp_BV.sum(dim=-1, keepdim=True).log_().add_(max_B1)


def requested(value: bool | int) -> bool:
    """Whether a ``logprobs``/``prompt_logprobs`` setting asks for log-probs at all (``0`` does, as in vLLM)."""
    return value is not False


def topk_count(value: bool | int) -> int:
    """How many alternatives a ``logprobs``/``prompt_logprobs`` setting asks for (``True`` means none)."""
    return 0 if isinstance(value, bool) else int(value)


def topk_pairs(ids_NK: torch.Tensor, logprobs_NK: torch.Tensor) -> list[list[tuple[int, float]]]:
    """Per row, ``(token_id, logprob)`` of the top-k alternatives, most likely first."""
    rows = zip(ids_NK.tolist(), logprobs_NK.tolist(), strict=True)
    return [list(zip(ids, values, strict=True)) for ids, values in rows]


def apply_repetition_penalty(logits_BV: torch.Tensor, seen_ids_BS: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty (as transformers and vLLM): seen tokens' logits are divided by it, or multiplied if < 0.

    ``seen_ids_BS`` may repeat ids (e.g. padding filled with a row's own
    token): the same value is written for every repeat.
    """
    seen_BS = logits_BV.gather(-1, seen_ids_BS)
    penalised_BS = torch.where(seen_BS < 0, seen_BS * penalty, seen_BS / penalty)
    return logits_BV.scatter(-1, seen_ids_BS, penalised_BS)


def _pick(
    scores_BV: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    unnormalised_probs_BV: torch.Tensor | None = None,
) -> torch.Tensor:
    """The filtered draw; ``unnormalised_probs_BV`` (``exp(scores - max)``, when at hand) saves a softmax at T=1."""
    if params.temperature == 0:
        return scores_BV.argmax(dim=-1)
    if params.top_k == -1 and params.top_p >= 1.0:
        if unnormalised_probs_BV is not None:
            return draw(unnormalised_probs_BV, generator)
        return draw(torch.softmax(scores_BV / params.temperature, dim=-1), generator)
    scaled_BV = scores_BV / params.temperature
    if params.top_k != -1:
        values_BK, ids_BK = scaled_BV.topk(min(params.top_k, scaled_BV.shape[-1]), dim=-1)
        return _draw_sorted(torch.softmax(values_BK, dim=-1), ids_BK, params.top_p, generator)
    return _draw_nucleus(torch.softmax(scaled_BV, dim=-1), params.top_p, generator)


def _draw_nucleus(probs_BV: torch.Tensor, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """Top-p over the whole vocabulary: searched among the best candidates, fully sorted only for wider rows."""
    probs_BK, ids_BK = probs_BV.topk(min(TOP_P_CANDIDATES, probs_BV.shape[-1]), dim=-1)
    tokens_B = _draw_sorted(probs_BK, ids_BK, top_p, generator)
    wide_W = (probs_BK.sum(dim=-1) < top_p).nonzero().squeeze(-1)  # rows whose nucleus exceeds the candidates
    if wide_W.numel():
        sorted_WV, order_WV = probs_BV[wide_W].sort(dim=-1, descending=True)
        tokens_B[wide_W] = _draw_sorted(sorted_WV, order_WV, top_p, generator)
    return tokens_B


def _draw_sorted(
    probs_BK: torch.Tensor, ids_BK: torch.Tensor, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw among candidates sorted most likely first, keeping those whose predecessors hold < ``top_p``."""
    if top_p < 1.0:
        before_BK = probs_BK.cumsum(dim=-1) - probs_BK
        probs_BK = probs_BK.masked_fill(before_BK >= top_p, 0.0)
    return ids_BK.gather(-1, draw(probs_BK, generator).unsqueeze(-1)).squeeze(-1)


def draw(weights_BN: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row with probability proportional to ``weights_BN`` (non-negative, any scale).

    Inverse-CDF sampling with one uniform number per row; zero-weight entries
    can never be drawn (the search returns the first index whose cumulative
    weight exceeds the draw).
    """
    cdf_BN = weights_BN.cumsum(dim=-1)
    total_B1 = cdf_BN[:, -1:]
    uniform_B1 = torch.rand(total_B1.shape, generator=generator, device=cdf_BN.device, dtype=cdf_BN.dtype)
    target_B1 = torch.minimum(uniform_B1 * total_B1, torch.nextafter(total_B1, torch.zeros_like(total_B1)))
    return torch.searchsorted(cdf_BN, target_B1, right=True).squeeze(-1)
