"""The pass engine: any mix of requests, from one adapter or many, in one forward and one backward per pass.

Every training call goes through :meth:`PassEngine.run`: ``forward_backward``
and ``forward_only`` (one :class:`LossPlan`), ``forward_backward_targets``
(one :class:`TargetsPlan`) and ``MultiLoraModel.forward_backward_many``
(several plans, any kinds). A plan's rows are cut into micro-batches as it
would be cut alone; chunks are packed whole into passes of at most
``micro_batch_size`` rows. A pass forwards its rows once, each row with its
own adapter (``route``), computes every plan's loss on its own rows, and
back-propagates their sum once: adapters share no trainable tensor and rows
do not interact, so each adapter gets exactly its own gradient.

A plan that fails (its loss raising or not finite) is dropped from the sum and
its adapter's gradients are put back as they were; the others go on.
Evaluation plans (``forward_only``, targets without backward) run in their own
passes, in eval mode and without autograd: dropout is per model, not per row.

Under data parallelism (one plan per call) every forward runs through
``parallel.run`` and every collective happens in the same order on every rank.
A decoder split into pipeline stages (``MegatronModel``'s, :class:`StagedDecoder`)
runs a call's passes one forward, one backward: each stage starts its layers on
the next pass before the current one's backward (:meth:`PassEngine._run_staged`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

from twinkle.data_format import FREE_EXPERT
from twinkle.model.parallel import Parallelism
from twinkle.model.passes.logps import (
    StagedDecoder,
    TokenLogpsResult,
    decode,
    inner_model,
    label_logps,
    logps_kernel,
    staged_decoder,
    start_decode,
    target_row_logps,
)
from twinkle.model.passes.loss_inputs import check_micro_batch_size
from twinkle.model.passes.plans import Plan, RowsView
from twinkle.model.passes.router_aux import RouterAux, router_aux_for
from twinkle.model.precision import MixedPrecision, autocast
from twinkle.module import replay_routing
from twinkle.processor import InputProcessor, select_rows

# Routes a pass's rows to adapters: the adapter name (None: none) of every row, for the block's forwards; the
# batch (None: a text-only one) shows which row each image belongs to.
RowRouter = Callable[[Sequence[str | None], Mapping[str, torch.Tensor] | None], AbstractContextManager[Any]]


class PassHost(Protocol):
    """What the engine uses of the model that owns it (a ``TrainingModel``)."""

    model: Any  # the transformers causal LM, possibly PEFT-wrapped (it may be replaced when adapters are added)
    device: torch.device
    parallel: Parallelism
    mixed_precision: MixedPrecision
    logps_chunk_size: int
    pad_token_id: int


class PassEngine:
    """Runs plans in shared passes over ``host.model``; ``route`` gives each row its adapter."""

    def __init__(self, host: PassHost, route: RowRouter) -> None:
        self.host, self.route = host, route

    def run(self, plans: Sequence[Plan], micro_batch_size: int | None = None) -> None:
        """Run every plan (each one's result gets its output or error). Training plans first, then evaluation."""
        check_micro_batch_size(micro_batch_size)
        training = [plan for plan in plans if plan.train]
        evaluating = [plan for plan in plans if not plan.train]
        if training:
            self._run_group(training, micro_batch_size)
        if evaluating:
            model = self.host.model
            model.eval()
            try:
                with torch.no_grad():
                    self._run_group(evaluating, None)
            finally:
                model.train()

    def label_logps(
        self, adapter: str | None, batch: dict[str, torch.Tensor], return_logits: bool = False
    ) -> TokenLogpsResult:
        """One adapter's label log-probs of ``batch`` (autograd as the caller's mode has it): the step API's forward."""
        rows, on_device = batch["input_ids"].shape[0], self._on_device(batch)
        with self._autocast(), self.route([adapter] * rows, on_device), self._replay(on_device):
            labels, _, _ = self.host.parallel.run(
                self._forward, self.host.model, on_device, {}, True, return_logits, None
            )
        assert labels is not None
        return labels

    # ------------------------------------------------------------------ passes

    def _run_group(self, plans: list[Plan], micro_batch_size: int | None) -> None:
        for plan in plans:
            if plan.train:
                plan.guard.save()
        start = time.perf_counter()
        passes = _passes(plans, micro_batch_size)
        staged = staged_decoder(self.host.model)
        try:
            if staged is None:
                for part in passes:
                    part = [(plan, first, count) for plan, first, count in part if not plan.failed]
                    if part:
                        self._pass(self._inputs(part))
            else:
                self._run_staged(passes, staged)
        finally:
            if staged is not None:
                staged.finish_passes()
        elapsed = time.perf_counter() - start
        total_tokens = sum(plan.token_count for plan in plans) or 1
        for plan in plans:
            if plan.failed:
                if plan.train:
                    plan.guard.restore()
                continue
            if plan.train:
                plan.state.accumulated += 1
            try:  # each plan is charged its share of the passes' time
                plan.finish(elapsed * plan.token_count / total_tokens, self.host.parallel)
            except Exception as exc:
                plan.fail(exc)
        for plan in plans:
            plan.guard.saved = []

    def _run_staged(self, passes: list[list[tuple[Plan, int, int]]], staged: StagedDecoder) -> None:
        """The passes through a decoder split into pipeline stages, one forward and one backward at a time: a
        rank ``passes_ahead`` stages from the last has started its stage on passes up to ``i + passes_ahead - 1``
        when it finishes pass ``i`` (the output layer and losses, which every stage computes together), and
        starts pass ``i + passes_ahead`` between pass ``i``'s loss and its backward, so every stage has work
        while the others back-propagate. A pass keeps the rows of a plan that failed in an earlier one (their
        loss is skipped): every stage must send and expect the same rows, and a stage ahead has sent them
        before the failure."""
        ahead = staged.passes_ahead
        prepared: dict[int, _PassInputs] = {}

        def start(index: int) -> None:
            if ahead and index < len(passes) and index not in prepared:
                prepared[index] = self._start(staged, self._inputs(passes[index]))

        for index, part in enumerate(passes):
            for earlier in range(index, index + ahead):  # the first passes, before any backward
                start(earlier)
            inputs = prepared.pop(index) if index in prepared else self._inputs(part)
            self._pass(inputs, before_backward=partial(start, index + ahead))

    def _inputs(self, part: list[tuple[Plan, int, int]]) -> _PassInputs:
        batch, spans = self._batch(part)
        adapters = [plan.state.name if plan.state.is_adapter else None for plan, _, _ in part]
        trains = any(plan.train for plan, _, _ in part)
        return _PassInputs(
            part,
            batch,
            spans,
            [name for name, (_, length) in zip(adapters, spans, strict=True) for _ in range(length)],
            router_aux_for(inner_model(self.host.model)) if trains else None,
        )

    def _start(self, staged: StagedDecoder, inputs: _PassInputs) -> _PassInputs:
        """Run this rank's pipeline stage on a later pass now, under that pass's adapters and experts."""
        try:
            on_device = inputs.on_device = self._on_device(inputs.batch)
            with self.route(inputs.row_adapters, on_device), self._replay(on_device), self._autocast():
                start_decode(staged, self.host.model, on_device, router_logits=inputs.router is not None)
        except Exception as exc:  # reported when the pass is finished
            inputs.error = exc
        return inputs

    def _pass(self, inputs: _PassInputs, before_backward: Callable[[], None] | None = None) -> None:
        """Forward the rows of ``inputs.part`` once, then back-propagate the sum of their plans' losses
        (``before_backward`` runs between the two, whether or not there is a loss to back-propagate)."""
        host, part, batch, spans = self.host, inputs.part, inputs.batch, inputs.spans
        target_rows = {
            spans[index][0] + offset: sequence
            for index, (plan, first, count) in enumerate(part)
            for offset, sequence in enumerate(plan.target_rows(first, count))
        }
        return_logits = any(plan.return_logits for plan, _, _ in part)
        reads_labels = any(plan.reads_labels for plan, _, _ in part)
        router = inputs.router
        try:
            if inputs.error is not None:
                raise inputs.error
            on_device = inputs.on_device if inputs.on_device is not None else self._on_device(batch)
            # Forward, loss and backward within the rows' adapters and experts: checkpointed layers recompute.
            with ExitStack() as routed:
                self._enter_routing(routed, inputs.row_adapters, on_device)
                with self._autocast():
                    labels, targets, router_logits = host.parallel.run(
                        self._forward, host.model, on_device, target_rows, reads_labels, return_logits, router
                    )
                total = self._total_loss(part, batch, spans, labels, targets, _RouterLosses(router, router_logits))
                if before_backward is not None:  # it routes another pass's rows: outside this one's, then back
                    routed.close()
                    before_backward()
                    self._enter_routing(routed, inputs.row_adapters, on_device)
                if total is not None:
                    total.backward()
        except Exception as exc:  # the pass itself failed: every plan in it reports it
            for plan, _, _ in part:
                plan.fail(exc)

    def _total_loss(
        self,
        part: list[tuple[Plan, int, int]],
        batch: dict[str, torch.Tensor],
        spans: list[tuple[int, int]],
        labels: TokenLogpsResult | None,
        targets: dict[int, torch.Tensor],
        router: _RouterLosses,
    ) -> torch.Tensor | None:
        parallel = self.host.parallel
        total: torch.Tensor | None = None
        shared = len(part) > 1
        for (plan, first, count), (start, length) in zip(part, spans, strict=True):
            if plan.failed:  # in an earlier pass; its rows ride along in a pipeline's (see _run_staged)
                continue
            rows = torch.arange(start, start + length)
            view = RowsView(
                first,
                count,
                select_rows(batch, rows) if shared else batch,
                None if labels is None else (labels.rows(rows.to(labels.logps_BT.device)) if shared else labels),
                [targets[row] for row in range(start, start + length) if row in targets],
                router.of_rows(batch, start, length) if plan.train else None,
            )
            try:
                loss = plan.loss(view, parallel)
            except Exception as exc:  # reported to this plan only
                plan.fail(exc)
                continue
            if loss is not None and plan.train:
                share = parallel.gradient_share(loss, plan.state.gradient_accumulation_steps)
                total = share if total is None else total + share
        return total

    def _batch(self, part: list[tuple[Plan, int, int]]) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
        """The pass's batch and each entry's ``(first row, rows)`` in it.

        A pass of one request collates it as it would be alone (its own
        processor: packed, left-padded...); several share one right-padded batch.
        """
        if len(part) == 1:
            plan, first, count = part[0]
            batch = plan.own_batch(first, count)
            return batch, [(0, int(batch["input_ids"].shape[0]))]
        features = [feature for plan, first, count in part for feature in plan.shared_features(first, count)]
        batch = InputProcessor(padding_side="right", pad_token_id=self.host.pad_token_id)(features)
        spans, start = [], 0
        for _, _, count in part:
            spans.append((start, count))
            start += count
        return batch, spans

    def _forward(
        self,
        model: Any,
        batch: dict[str, torch.Tensor],
        target_rows: dict[int, Any],
        reads_labels: bool,
        return_logits: bool,
        router: RouterAux | None,
    ) -> tuple[TokenLogpsResult | None, dict[int, torch.Tensor], list[torch.Tensor] | None]:
        """The decoder once, then the output layer on the positions that predict labels or targets."""
        decoded = decode(model, batch, self.host.parallel.sequence, router_logits=router is not None)
        hidden_BTH, chunk_size, kernel = decoded.hidden_BTH, self.host.logps_chunk_size, logps_kernel(model)
        labels = label_logps(model, hidden_BTH, batch, chunk_size, return_logits, kernel) if reads_labels else None
        targets = target_row_logps(model, hidden_BTH, target_rows, chunk_size, kernel) if target_rows else {}
        return labels, targets, decoded.router_logits_BTE

    def _enter_routing(self, stack: ExitStack, row_adapters: Sequence[str | None], batch: dict[str, Any]) -> None:
        """The pass's rows' adapters (``route``) and recorded experts (``_replay``), entered on ``stack``."""
        stack.enter_context(self.route(row_adapters, batch))
        stack.enter_context(self._replay(batch))

    def _replay(self, batch: dict[str, torch.Tensor]) -> AbstractContextManager[None]:
        """Router replay of the batch's recorded experts (features from a sampler that recorded them)."""
        routed_BTLK, sequence = batch.get("routed_experts"), self.host.parallel.sequence
        if routed_BTLK is not None and sequence is not None:  # the routers see this rank's tokens only
            routed_BTLK = sequence.own_tokens(routed_BTLK, FREE_EXPERT)
        return replay_routing(inner_model(self.host.model), routed_BTLK)

    def _on_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: tensor.to(self.host.device) for name, tensor in batch.items()}

    def _autocast(self) -> AbstractContextManager[Any]:
        return autocast(self.host.device.type, self.host.mixed_precision)


@dataclass
class _PassInputs:
    """A pass's entries ``(plan, first chunk row, rows)``, their batch, each entry's ``(first row, rows)`` in it,
    every row's adapter, and the router loss (``None``: none); once started on the device, its batch there (and
    the error starting it raised)."""

    part: list[tuple[Plan, int, int]]
    batch: dict[str, torch.Tensor]
    spans: list[tuple[int, int]]
    row_adapters: list[str | None]
    router: RouterAux | None
    on_device: dict[str, torch.Tensor] | None = None
    error: Exception | None = None


class _RouterLosses:
    """A pass's router logits (``None``: the model computes no router loss), cut into each plan's rows."""

    def __init__(self, router: RouterAux | None, logits_BTE: list[torch.Tensor] | None) -> None:
        self.router, self.logits_BTE = router, logits_BTE

    def of_rows(self, batch: dict[str, torch.Tensor], start: int, length: int) -> tuple[torch.Tensor, float] | None:
        """Rows ``start:start+length``'s router loss (over their unpadded tokens) and its weight in the loss."""
        if self.router is None or self.logits_BTE is None:
            return None
        rows = slice(start, start + length)
        mask = batch.get("attention_mask")
        tokens_BT = torch.ones_like(batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool()
        tokens_BT = tokens_BT[rows].to(self.logits_BTE[0].device)
        return self.router.loss([logits[rows] for logits in self.logits_BTE], tokens_BT), self.router.coef


def _passes(plans: list[Plan], micro_batch_size: int | None) -> list[list[tuple[Plan, int, int]]]:
    """Plans' chunks packed whole, in order, into passes of at most ``micro_batch_size`` rows (one pass if None)."""
    passes: list[list[tuple[Plan, int, int]]] = [[]]
    rows = 0
    for plan in plans:
        for first, count in plan.chunks(micro_batch_size):
            if passes[-1] and micro_batch_size is not None and rows + count > micro_batch_size:
                passes.append([])
                rows = 0
            passes[-1].append((plan, first, count))
            rows += count
    return passes
