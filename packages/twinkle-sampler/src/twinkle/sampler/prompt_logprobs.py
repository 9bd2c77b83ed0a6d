"""Log-probabilities of the prompt tokens themselves, from the prefill's hidden states.

The output layer runs chunk by chunk over one prompt at a time, so a long
prompt never holds its full ``[T, V]`` logits at once; log-probs come from the
trainer's own function, so prompt log-probs match its ``forward_only``. Inside
an :func:`twinkle.module.adapter_rows` block an adapted output layer gives
each prompt's positions that prompt's adapter.
"""

from __future__ import annotations

import torch

from twinkle.module import per_token, token_logps_from_logits
from twinkle.sampler.results import TopK
from twinkle.sampler.token_sampling import topk_count, topk_pairs

CHUNK_TOKENS = 1024


def prompt_logprobs(
    head: torch.nn.Module,
    hidden_BLH: torch.Tensor,
    ids_BL: torch.Tensor,
    mask_BL: torch.Tensor,
    setting: bool | int,
) -> tuple[list[list[float | None]], list[list[TopK | None]] | None]:
    """Per left-padded prompt: ``log p(token_t | tokens < t)`` (``None`` at t=0), and the top-k alternatives.

    ``setting`` is ``SamplingParams.prompt_logprobs``: an int ``k > 0`` also
    asks for the ``k`` most likely tokens at every position.
    """
    k = topk_count(setting)
    logprobs: list[list[float | None]] = []
    alternatives: list[list[TopK | None]] | None = [] if k else None
    for row in range(ids_BL.shape[0]):
        start = int((mask_BL[row] == 0).sum())
        hidden_NH, targets_N = hidden_BLH[row, start:-1], ids_BL[row, start + 1 :]
        rows_N = torch.full_like(targets_N, row)
        row_logprobs: list[float | None] = [None]
        row_alternatives: list[TopK | None] = [None]
        for chunk in range(0, targets_N.shape[0], CHUNK_TOKENS):
            span = slice(chunk, chunk + CHUNK_TOKENS)
            logits_CV = per_token(head, rows_N[span])(hidden_NH[span]).float()
            row_logprobs.extend(token_logps_from_logits(logits_CV, targets_N[span]).tolist())
            if k:
                values_CK, ids_CK = logits_CV.topk(min(k, logits_CV.shape[-1]), dim=-1)
                logsumexp_C1 = torch.logsumexp(logits_CV, dim=-1, keepdim=True)
                row_alternatives.extend(topk_pairs(ids_CK, values_CK - logsumexp_C1))
        logprobs.append(row_logprobs)
        if alternatives is not None:
            alternatives.append(row_alternatives)
    return logprobs, alternatives
