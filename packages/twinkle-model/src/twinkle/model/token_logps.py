"""Per-token log-probabilities of a collated batch, computed only where there are labels.

The decoder runs once over all tokens; the output layer runs only on the
hidden states that predict a supervised label (prompt tokens cost nothing
there) and in chunks, so the ``[B, T, V]`` logits never exist at once.
:func:`output_layer_logps` is that output-layer step, shared with the
explicit-target path (:mod:`twinkle.model.targets`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from twinkle.data_format import IGNORE_INDEX
from twinkle.module import MultiLoraLinear, TokenLogps, chunked_token_logps, logps_dtype, per_token
from twinkle.processor import model_inputs


@dataclass
class TokenLogpsResult:
    """``logps_BT[b, t] = log p(labels[b, t] | tokens < t)``, 0 where unlabelled; ``correct_BT`` argmax hits.

    ``logits_BTV`` (in the log-probs' dtype) only when asked for: it is the large tensor the rest avoids.
    """

    logps_BT: torch.Tensor
    correct_BT: torch.Tensor
    supervised_BT: torch.Tensor
    logits_BTV: torch.Tensor | None = None


def output_layer_logps(
    head: torch.nn.Module, hidden_NH: torch.Tensor, targets_NK: torch.Tensor, rows_N: torch.Tensor, chunk_size: int
) -> TokenLogps:
    """``log p(targets_NK[n, k])`` under the logits ``head(hidden_NH[n])``, and argmax hits of ``targets_NK[:, 0]``.

    ``rows_N[n]`` is the batch row that position ``n`` comes from, so a head
    with per-row LoRA adapters (``MultiLoraLinear``) gives each position its
    row's adapter (folded into the fused chunks as low-rank terms). Only
    ``chunk_size`` positions' logits exist at a time.
    """
    if isinstance(head, (torch.nn.Linear, MultiLoraLinear)) and _fused(head) and targets_NK.shape[1] == 1:
        terms = head.low_rank_terms(hidden_NH, rows_N) if isinstance(head, MultiLoraLinear) else []
        logps_N, correct_N = chunked_token_logps(hidden_NH, head.weight, targets_NK[:, 0], chunk_size, low_rank=terms)
        return TokenLogps(logps_N.unsqueeze(1), correct_N)
    # K targets, or another head (biased, PEFT-adapted): run the module itself, chunk by chunk,
    # recomputing each chunk's logits in backward instead of keeping them.
    logps, correct = [], []
    for start in range(0, max(hidden_NH.shape[0], 1), chunk_size):  # no position: one empty chunk
        span = slice(start, start + chunk_size)
        head_C = per_token(head, rows_N[span])
        logps_CK, correct_C = checkpoint(_chunk_logps, head_C, hidden_NH[span], targets_NK[span], use_reentrant=False)
        logps.append(logps_CK)
        correct.append(correct_C)
    return TokenLogps(torch.cat(logps), torch.cat(correct))


def _fused(head: torch.nn.Linear | MultiLoraLinear) -> bool:
    """``hidden @ weight.T`` (plus per-row LoRA updates): what :func:`chunked_token_logps` computes.

    Subclasses (quantised linears, say) may compute something else from ``weight``.
    """
    return type(head) in (torch.nn.Linear, MultiLoraLinear) and head.bias is None


def _chunk_logps(
    head: Callable[[torch.Tensor], torch.Tensor], hidden_CH: torch.Tensor, targets_CK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_CV = head(hidden_CH)
    logits_CV = logits_CV.to(logps_dtype(logits_CV.dtype))
    logps_CK = logits_CV.gather(-1, targets_CK) - torch.logsumexp(logits_CV, dim=-1, keepdim=True)
    return logps_CK, logits_CV.detach().argmax(-1) == targets_CK[:, 0]


def causal_token_logps(
    model: Any, batch: Mapping[str, torch.Tensor], chunk_size: int = 4096, return_logits: bool = False
) -> TokenLogpsResult:
    """Run ``model`` (a transformers causal LM, possibly PEFT-wrapped) on ``batch``."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden_BTH = inner.get_decoder()(**model_inputs(batch)).last_hidden_state
    labels_BT = batch["labels"]
    supervised_BT = labels_BT != IGNORE_INDEX
    supervised_BT[:, 0] = False  # nothing precedes the first position
    # The hidden state at t-1 predicts the label at t.
    predictors_BT = torch.zeros_like(supervised_BT)
    predictors_BT[:, :-1] = supervised_BT[:, 1:]
    head = inner.get_output_embeddings()
    rows_N = predictors_BT.nonzero(as_tuple=True)[0]
    logps_N1, correct_N = output_layer_logps(
        head, hidden_BTH[predictors_BT], labels_BT[supervised_BT].unsqueeze(1), rows_N, chunk_size
    )
    logps_N = logps_N1.squeeze(1)
    logps_BT = torch.zeros(labels_BT.shape, dtype=logps_N.dtype, device=labels_BT.device)
    logps_BT = logps_BT.masked_scatter(supervised_BT, logps_N)
    correct_BT = torch.zeros_like(supervised_BT).masked_scatter(supervised_BT, correct_N)
    logits_BTV = head(hidden_BTH).to(logps_N.dtype) if return_logits else None
    return TokenLogpsResult(logps_BT, correct_BT, supervised_BT, logits_BTV)


def merge_token_counts(results: Sequence[TokenLogpsResult]) -> TokenLogpsResult:
    """Token counts of several micro-batches, for metrics (shapes may differ, so flatten)."""
    return TokenLogpsResult(
        torch.cat([r.logps_BT.detach().flatten() for r in results]),
        torch.cat([r.correct_BT.flatten() for r in results]),
        torch.cat([r.supervised_BT.flatten() for r in results]),
    )
