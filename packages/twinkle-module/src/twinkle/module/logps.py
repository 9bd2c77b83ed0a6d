"""Per-token log-probabilities of label tokens without materialising ``[B, T, V]`` logits.

For a 151k vocabulary, full float32 logits of a batch of 8×4096 tokens take
20 GB. :func:`chunked_token_logps` walks over the tokens in chunks so only one
chunk's logits are alive at a time. When all chunks' probabilities fit in
``max_saved_bytes`` (4 GiB by default; a plain cross-entropy over the same
tokens keeps its logits *and* their log-softmax, twice as much) they are kept
for the backward, so nothing is computed twice; beyond that the backward
recomputes each chunk's logits instead of storing them (the trade made by
fused linear cross-entropy kernels, which replace this function on GPU later). Callers pass only supervised positions,
so prompt tokens cost nothing in the output layer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from twinkle.data_format import IGNORE_INDEX

DEFAULT_MAX_SAVED_BYTES = 4 << 30


def logps_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype log-probabilities are computed in: float32 for half-precision logits, else theirs (float64 stays)."""
    return torch.promote_types(dtype, torch.float32)


class TokenLogps(NamedTuple):
    """``logps_N`` (float32, or float64 for float64 weights; differentiable) and ``correct_N`` (argmax == label)."""

    logps: torch.Tensor
    correct: torch.Tensor


def token_logps_from_logits(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]`` per row, in :func:`logps_dtype`; 0 where the label is ignored."""
    logits_NV = logits_NV.to(logps_dtype(logits_NV.dtype))
    valid_N = labels_N != IGNORE_INDEX
    safe_N = torch.where(valid_N, labels_N, 0)
    picked_N = logits_NV.gather(-1, safe_N.unsqueeze(-1)).squeeze(-1)
    logps_N = picked_N - torch.logsumexp(logits_NV, dim=-1)
    return torch.where(valid_N, logps_N, 0.0)


class _ChunkedTokenLogps(torch.autograd.Function):
    """``logps_N = log_softmax(hidden_NH @ weight_VH.T)[labels_N]`` with O(chunk × V) live memory."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_NH: torch.Tensor,
        weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        chunk_size: int,
        save_probs: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = logps_dtype(weight_VH.dtype)
        logps_N = torch.empty(labels_N.shape, dtype=dtype, device=hidden_NH.device)
        correct_N = torch.empty(labels_N.shape, dtype=torch.bool, device=hidden_NH.device)
        saved_probs = []
        for start in range(0, hidden_NH.shape[0], chunk_size):
            end = start + chunk_size
            logits_CV = (hidden_NH[start:end] @ weight_VH.T).to(dtype)
            logps_N[start:end] = token_logps_from_logits(logits_CV, labels_N[start:end])
            correct_N[start:end] = logits_CV.argmax(-1) == labels_N[start:end]
            if save_probs:
                saved_probs.append(torch.softmax(logits_CV, dim=-1))
        ctx.save_for_backward(hidden_NH, weight_VH, labels_N)
        ctx.chunk_size, ctx.saved_probs = chunk_size, saved_probs
        ctx.mark_non_differentiable(correct_N)
        return logps_N, correct_N

    @staticmethod
    def backward(  # one gradient per input of forward
        ctx: Any, grad_logps_N: torch.Tensor, _grad_correct: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden_NH, weight_VH, labels_N = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_NH) if need_hidden else None
        dtype = logps_dtype(weight_VH.dtype)
        grad_weight = torch.zeros(weight_VH.shape, dtype=dtype, device=weight_VH.device) if need_weight else None
        for index, start in enumerate(range(0, hidden_NH.shape[0], ctx.chunk_size)):
            end = start + ctx.chunk_size
            hidden_CH, labels_C = hidden_NH[start:end], labels_N[start:end]
            if ctx.saved_probs:
                probs_CV = ctx.saved_probs[index]
            else:
                probs_CV = torch.softmax((hidden_CH @ weight_VH.T).to(dtype), dim=-1)
            valid_C = labels_C != IGNORE_INDEX
            # d logp / d logits = onehot(label) - softmax(logits), scaled by the incoming gradient.
            scale_C = torch.where(valid_C, grad_logps_N[start:end].to(dtype), 0.0)
            grad_logits_CV = probs_CV.mul_(-scale_C.unsqueeze(-1))
            rows = valid_C.nonzero(as_tuple=True)[0]
            grad_logits_CV[rows, labels_C[rows]] += scale_C[rows]
            grad_logits_CV = grad_logits_CV.to(hidden_NH.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits_CV @ weight_VH
            if grad_weight is not None:
                grad_weight += (grad_logits_CV.T @ hidden_CH).to(dtype)
        ctx.saved_probs = []
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VH.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_token_logps(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    chunk_size: int = 4096,
    max_saved_bytes: int = DEFAULT_MAX_SAVED_BYTES,
) -> TokenLogps:
    """Log-probabilities of ``labels_N`` under the logits ``hidden_NH @ weight_VH.T``.

    The caller aligns hidden states and labels (for causal LMs: the hidden state
    of position ``t-1`` with the label of position ``t``). Ignored labels get 0.
    Memory is bounded by ``chunk_size × V`` plus, only if it fits in
    ``max_saved_bytes``, the probabilities kept for the backward.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    itemsize = torch.empty((), dtype=logps_dtype(weight_VH.dtype)).element_size()
    save_probs = labels_N.numel() * weight_VH.shape[0] * itemsize <= max_saved_bytes
    logps_N, correct_N = _ChunkedTokenLogps.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        hidden_NH, weight_VH, labels_N, chunk_size, save_probs
    )
    return TokenLogps(logps_N, correct_N)
