"""Per-token log-probabilities of one forward: of a batch's shifted labels, and of rows' explicit targets.

The decoder runs once over all rows (:func:`decode`); the output layer
then runs only on the hidden states that predict something, in chunks, so the
``[B, T, V]`` logits never exist at once. A row predicts either its own
shifted ``labels`` (an ``InputFeature``: :func:`label_logps`) or explicit
targets per position (Tinker's layout, :class:`TargetSequence`: ``tokens[t]``
predicts ``targets[t]``, one id or K: :func:`target_row_logps`). Both go
through :func:`output_layer_logps`, which runs a model's kernelized
``linear_logps`` kernel (twinkle-kernels' Triton op, :func:`logps_kernel`)
where it can, and the PyTorch chunked path otherwise; an output layer split by
vocabulary over ranks computes them itself (:class:`ShardedOutputLayer`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.checkpoint import checkpoint

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Kernel
from twinkle.kernel import OUTPUT_LOGPS, get_kernel_report
from twinkle.model.parallel.ulysses import SequenceParallel
from twinkle.model.passes.multimodal import multimodal_base, packed_multimodal_positions
from twinkle.model.passes.requests import TargetSequence, check_sequences, model_limits
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

    def rows(self, rows: torch.Tensor) -> TokenLogpsResult:
        """The result of rows ``rows`` only (without logits)."""
        tensors = (self.logps_BT, self.correct_BT, self.supervised_BT)
        return TokenLogpsResult(*(tensor.index_select(0, rows) for tensor in tensors))


def inner_model(model: Any) -> Any:
    """The transformers model itself, without a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@dataclass
class DecoderOutput:
    """The decoder's last hidden states, and (when asked for) every MoE layer's router logits ``[B, T, E]``."""

    hidden_BTH: torch.Tensor
    router_logits_BTE: list[torch.Tensor] | None = None


@runtime_checkable
class StagedDecoder(Protocol):
    """A decoder split into pipeline stages (MegatronModel's), which can run this rank's stage of a later pass
    before the current pass finishes (a one-forward-one-backward schedule)."""

    @property
    def passes_ahead(self) -> int:
        """How many later passes to :meth:`start` before finishing a pass (0: one pass at a time)."""
        ...

    def start(self, **inputs: Any) -> None:
        """This rank's stage on a later pass (``decode``'s inputs); the decoder's forward on them finishes it."""
        ...

    def finish_passes(self) -> None:
        """After a call's passes: drop what was started and not finished, wait for what is in flight."""
        ...


def staged_decoder(model: Any) -> StagedDecoder | None:
    """``model``'s decoder if it is split into pipeline stages."""
    decoder = getattr(inner_model(model), "get_decoder", lambda: None)()
    return decoder if isinstance(decoder, StagedDecoder) else None


def start_decode(
    decoder: StagedDecoder, model: Any, batch: Mapping[str, torch.Tensor], router_logits: bool = False
) -> None:
    """Start ``decoder`` on ``batch`` (see :class:`StagedDecoder`); :func:`decode` on the same batch finishes it."""
    decoder.start(**_decoder_inputs(inner_model(model), batch, router_logits))


def decode(
    model: Any, batch: Mapping[str, torch.Tensor], sequence: SequenceParallel | None = None, router_logits: bool = False
) -> DecoderOutput:
    """The decoder of ``model`` (a causal LM, possibly PEFT-wrapped) on ``batch``.

    With a ``sequence`` group, this rank computes its share of the tokens and the group's are gathered.
    """
    inner = inner_model(model)
    inputs = _decoder_inputs(inner, batch, router_logits)
    decoder = multimodal_base(inner) if "pixel_values" in inputs else inner.get_decoder()
    if sequence is not None:
        return DecoderOutput(*sequence.decode(decoder, inputs))
    output = decoder(**inputs)
    if not router_logits:
        return DecoderOutput(output.last_hidden_state)
    rows, length = batch["input_ids"].shape
    return DecoderOutput(output.last_hidden_state, [logits.view(rows, length, -1) for logits in output.router_logits])


def _decoder_inputs(inner: Any, batch: Mapping[str, torch.Tensor], router_logits: bool) -> dict[str, Any]:
    inputs = model_inputs(batch, packed_multimodal_positions(inner, batch))
    if router_logits:
        inputs["output_router_logits"] = True
    return inputs


def logps_kernel(model: Any) -> Kernel | None:
    """The ``linear_logps`` kernel :func:`twinkle.kernel.kernelize` put into ``model`` (``None`` when there is none)."""
    report = get_kernel_report(inner_model(model))
    return None if report is None else report.kernels.get(OUTPUT_LOGPS)


def output_layer_logps(
    head: torch.nn.Module,
    hidden_NH: torch.Tensor,
    targets_NK: torch.Tensor,
    rows_N: torch.Tensor,
    chunk_size: int,
    kernel: Kernel | None = None,
) -> TokenLogps:
    """``log p(targets_NK[n, k])`` under the logits ``head(hidden_NH[n])``, and argmax hits of ``targets_NK[:, 0]``.

    ``rows_N[n]`` is the batch row that position ``n`` comes from, so a head
    with per-row LoRA adapters (``MultiLoraLinear``) gives each position its
    row's adapter (folded into the fused chunks as low-rank terms). Only
    ``chunk_size`` positions' logits exist at a time; a ``linear_logps``
    ``kernel`` available on the device computes them tile by tile instead.
    """
    if isinstance(head, (torch.nn.Linear, MultiLoraLinear)) and _fused(head) and targets_NK.shape[1] == 1:
        terms = head.low_rank_terms(hidden_NH, rows_N) if isinstance(head, MultiLoraLinear) else []
        weight_VH = head.weight
        # float64 would take the kernel's reference, which builds every logit at once
        if kernel is not None and kernel.available(hidden_NH.device) and weight_VH.dtype != torch.float64:
            fused = kernel(hidden_NH.to(weight_VH.dtype), weight_VH, targets_NK[:, 0], terms, chunk_size=chunk_size)
            return TokenLogps(fused.logps.unsqueeze(1), fused.correct)
        logps_N, correct_N = chunked_token_logps(hidden_NH, weight_VH, targets_NK[:, 0], chunk_size, low_rank=terms)
        return TokenLogps(logps_N.unsqueeze(1), correct_N)
    # K targets, or another head (biased, PEFT-adapted, split by vocabulary): run the module itself, chunk by
    # chunk, recomputing each chunk's logits in backward instead of keeping them.
    logps, correct = [], []
    for start in range(0, max(hidden_NH.shape[0], 1), chunk_size):  # no position: one empty chunk
        span = slice(start, start + chunk_size)
        if isinstance(head, ShardedOutputLayer):
            chunk_logps = head.token_logps_for(rows_N[span])
        else:
            chunk_logps = partial(_chunk_logps, per_token(head, rows_N[span]))
        logps_CK, correct_C = checkpoint(chunk_logps, hidden_NH[span], targets_NK[span], use_reentrant=False)
        logps.append(logps_CK)
        correct.append(correct_C)
    return TokenLogps(torch.cat(logps), torch.cat(correct))


@runtime_checkable
class ShardedOutputLayer(Protocol):
    """An output layer split by vocabulary over ranks (MegatronModel's under tensor or pipeline parallelism),
    which computes chosen tokens' log-probabilities from its own slice of the logits, exchanging per-token
    numbers only."""

    def token_logps_for(
        self, rows_N: torch.Tensor
    ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``(hidden_NH, targets_NK) -> (log p(targets_NK), argmax == targets_NK[:, 0])`` on ``N`` flattened
        tokens, token ``n`` one of batch row ``rows_N[n]`` (whose adapter it gets)."""
        ...


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


def label_logps(
    model: Any,
    hidden_BTH: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    chunk_size: int,
    return_logits: bool,
    kernel: Kernel | None = None,
) -> TokenLogpsResult:
    """The log-probs of ``batch['labels']`` (rows without labels cost nothing)."""
    labels_BT = batch["labels"]
    supervised_BT = labels_BT != IGNORE_INDEX
    supervised_BT[:, 0] = False  # nothing precedes the first position
    # The hidden state at t-1 predicts the label at t.
    predictors_BT = torch.zeros_like(supervised_BT)
    predictors_BT[:, :-1] = supervised_BT[:, 1:]
    head = inner_model(model).get_output_embeddings()
    rows_N = predictors_BT.nonzero(as_tuple=True)[0]
    logps_N1, correct_N = output_layer_logps(
        head, hidden_BTH[predictors_BT], labels_BT[supervised_BT].unsqueeze(1), rows_N, chunk_size, kernel
    )
    logps_N = logps_N1.squeeze(1)
    logps_BT = torch.zeros(labels_BT.shape, dtype=logps_N.dtype, device=labels_BT.device)
    logps_BT = logps_BT.masked_scatter(supervised_BT, logps_N)
    correct_BT = torch.zeros_like(supervised_BT).masked_scatter(supervised_BT, correct_N)
    logits_BTV = head(hidden_BTH).to(logps_N.dtype) if return_logits else None
    return TokenLogpsResult(logps_BT, correct_BT, supervised_BT, logits_BTV)


def target_row_logps(
    model: Any,
    hidden_BTH: torch.Tensor,
    rows: Mapping[int, TargetSequence],
    chunk_size: int,
    kernel: Kernel | None = None,
) -> dict[int, torch.Tensor]:
    """Per batch row in ``rows``, ``log p(targets[t] | tokens[:t+1])`` shaped like its targets.

    Each row holds its sequence's tokens from position 0 (right padding). Rows
    are grouped by their targets per position (1 or K), so the common
    one-target case runs the fused output layer.
    """
    head = inner_model(model).get_output_embeddings()
    device = hidden_BTH.device
    by_width: dict[int, list[int]] = {}
    for row, sequence in rows.items():
        by_width.setdefault(_width(sequence), []).append(row)
    result: dict[int, torch.Tensor] = {}
    for width, group in by_width.items():
        lengths = [len(rows[row].tokens) for row in group]
        hidden_NH = torch.cat([hidden_BTH[row, :n] for row, n in zip(group, lengths, strict=True)])
        targets_NK = torch.cat([rows[row].targets.reshape(n, width) for row, n in zip(group, lengths, strict=True)])
        rows_N = torch.repeat_interleave(torch.tensor(group), torch.tensor(lengths)).to(device)
        logps_NK = output_layer_logps(head, hidden_NH, targets_NK.to(device), rows_N, chunk_size, kernel).logps
        for row, piece in zip(group, logps_NK.split(lengths), strict=True):
            result[row] = piece.reshape(rows[row].targets.shape)
    return result


def _width(sequence: TargetSequence) -> int:
    return 1 if sequence.targets.dim() == 1 else int(sequence.targets.shape[1])


def sequence_batch(sequences: Sequence[TargetSequence], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The right-padded ``[B, T]`` batch of the sequences' tokens, as a model takes it (no labels)."""
    lengths = [len(sequence.tokens) for sequence in sequences]
    batch_size, length = len(sequences), max(lengths)
    input_ids_BT = torch.full((batch_size, length), pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros(batch_size, length, dtype=torch.long)
    for row, (sequence, n) in enumerate(zip(sequences, lengths, strict=True)):
        input_ids_BT[row, :n] = sequence.tokens
        mask_BT[row, :n] = 1
    position_ids_BT = torch.arange(length).expand(batch_size, length) * mask_BT
    return {"input_ids": input_ids_BT, "attention_mask": mask_BT, "position_ids": position_ids_BT}


def target_logps(
    model: torch.nn.Module, sequences: Sequence[TargetSequence], chunk_size: int = 4096
) -> list[torch.Tensor]:
    """``log p(targets[t] | tokens[:t+1])`` per sequence, float32 with autograd, shaped like each ``targets``.

    ``model`` is a transformers causal LM, possibly PEFT-wrapped; the output layer
    runs over ``chunk_size`` positions at a time.
    """
    check_sequences(sequences, *model_limits(model))
    check_chunk_size(chunk_size)
    device = inner_model(model).get_input_embeddings().weight.device
    batch = {name: tensor.to(device) for name, tensor in sequence_batch(sequences, 0).items()}
    hidden_BTH = decode(model, batch).hidden_BTH
    logps = target_row_logps(model, hidden_BTH, dict(enumerate(sequences)), chunk_size, logps_kernel(model))
    return [logps[row] for row in range(len(sequences))]


def check_chunk_size(chunk_size: Any) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidInputError(f"chunk_size must be a positive int, got {chunk_size!r}")


def merge_token_counts(results: Sequence[TokenLogpsResult]) -> TokenLogpsResult:
    """Token counts of several micro-batches, for metrics (shapes may differ, so flatten)."""
    return TokenLogpsResult(
        torch.cat([r.logps_BT.detach().flatten() for r in results]),
        torch.cat([r.correct_BT.flatten() for r in results]),
        torch.cat([r.supervised_BT.flatten() for r in results]),
    )
