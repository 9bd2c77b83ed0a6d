"""Per-token log-probabilities of a collated batch, computed only where there are labels.

The decoder runs once over all tokens; the output layer runs only on the
hidden states that predict a supervised label (prompt tokens cost nothing
there) and in chunks, so the ``[B, T, V]`` logits never exist at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from twinkle.data_format import IGNORE_INDEX
from twinkle.module import chunked_token_logps, token_logps_from_logits
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


def _output_layer_logps(
    head: torch.nn.Module, hidden_NH: torch.Tensor, labels_N: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if type(head) is torch.nn.Linear and head.bias is None:
        return chunked_token_logps(hidden_NH, head.weight, labels_N, chunk_size)
    # An adapted or biased head (e.g. LoRA on lm_head): run the module itself, chunk by chunk,
    # recomputing each chunk's logits in backward instead of keeping them.
    logps, correct = [], []
    for start in range(0, hidden_NH.shape[0], chunk_size):
        hidden_CH, labels_C = hidden_NH[start : start + chunk_size], labels_N[start : start + chunk_size]
        logps.append(
            checkpoint(lambda h, y: token_logps_from_logits(head(h), y), hidden_CH, labels_C, use_reentrant=False)
        )
        with torch.no_grad():
            correct.append(head(hidden_CH).argmax(-1) == labels_C)
    return torch.cat(logps), torch.cat(correct)


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
    logps_N, correct_N = _output_layer_logps(head, hidden_BTH[predictors_BT], labels_BT[supervised_BT], chunk_size)
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
