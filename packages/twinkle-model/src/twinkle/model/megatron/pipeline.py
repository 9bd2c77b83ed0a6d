"""Pipeline parallelism for :class:`MegatronModel`: each stage holds a contiguous run of decoder layers.

megatron-core builds the layers of this rank's pipeline stage (``TransformerBlock`` asks
``parallel_state``); its schedules and its embedding-group all-reduce need CUDA, so the hand-offs are
our own autograd functions on torch.distributed point-to-point, which any backend has:

- a stage after the first receives the previous stage's hidden states (:func:`receive_hidden`) and
  sends their gradient back in backward;
- the last stage applies the final norm and sends the result to every stage (:func:`send_final`), so
  every stage gets the same log-probs and losses as one process would: the pass engine, losses and
  metrics run unchanged on every rank. The stages split the output layer's vocabulary (:mod:`.head`);
  each one's part of the final hidden states' gradient is summed onto the last stage's, which
  back-propagates it;
- an earlier stage sends its output on (:func:`send_on`), later receives the last stage's
  (:func:`receive_final`) and then its output's gradient from the next stage;
- what the loss needs from every stage's layers (the routers' logits, for the load-balancing loss) is
  gathered onto every stage (:func:`gather_over_stages`); each stage back-propagates its own part.

Sends do not wait for their receiver (:class:`Outbox`), and an earlier stage sends its output on before it
needs the last stage's, so a stage can run its layers on the next micro-batch while later stages are busy
with this one: the pass engine's one-forward-one-backward schedule (``passes_ahead``, see
:class:`.decoder.MegatronDecoder`). Each stream between two ranks (outputs on, gradients back, the final
hidden states) is received in the order it is sent, whatever the backend (NCCL ignores tags).

The word embeddings (and an untied output layer) are replicated on every stage: the first stage's copy of
the embeddings gets their gradient, each stage's copy of the output layer its part of the vocabulary's, and
the copies' gradients are summed over the pipeline group, so every copy steps the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


@dataclass(frozen=True)
class PipelineStage:
    """This rank's place in its pipeline: stage ``index`` of ``size``, holding layers from ``first_layer``."""

    index: int
    size: int
    first_layer: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def of_this_rank(cls, num_layers: int) -> PipelineStage:
        """From megatron-core's parallel state (``initialize_model_parallel`` has run)."""
        size = parallel_state.get_pipeline_model_parallel_world_size()
        index = parallel_state.get_pipeline_model_parallel_rank()
        group = parallel_state.get_pipeline_model_parallel_group() if size > 1 else None
        return cls(index, size, index * num_layers // size, group)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def global_name(self, name: str) -> str:
        """A parameter name with this stage's local layer numbers made the model's (``decoder.layers.i.``)."""
        if self.first_layer == 0:
            return name
        return _LAYER.sub(lambda match: f"decoder.layers.{int(match[1]) + self.first_layer}.", name)


# Tags of the three streams between stages (gloo matches on them; NCCL ignores them and needs no more).
_OUTPUT, _GRADIENT, _FINAL = 1, 2, 3


class Outbox:
    """This rank's sends still in flight: a send returns at once, and its tensor is kept until it arrives."""

    def __init__(self) -> None:
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, destination: int, tag: int) -> None:
        tensor = tensor.detach().clone(memory_format=torch.contiguous_format)  # nothing may write it in flight
        self._pending = [(work, kept) for work, kept in self._pending if not work.is_completed()]
        work = dist.isend(tensor, destination, tag=tag)
        assert work is not None  # a request of the default group, which this rank belongs to
        self._pending.append((work, tensor))

    def wait(self) -> None:
        """Until every send has been received."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


def receive_hidden(like: torch.Tensor, outbox: Outbox) -> torch.Tensor:
    """The previous stage's output (``like``'s shape and dtype); backward sends its gradient back."""
    anchor = torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)  # puts it in the graph
    source = parallel_state.get_pipeline_model_parallel_prev_rank()
    received: torch.Tensor = _Receive.apply(anchor, tuple(like.shape), source, _OUTPUT, outbox)  # type: ignore[no-untyped-call]
    return received


def send_on(hidden: torch.Tensor, outbox: Outbox) -> torch.Tensor:
    """Send this (not last) stage's output to the next stage; the returned anchor's backward receives its
    gradient from there. :func:`receive_final` takes the anchor, so backward reaches this stage's layers."""
    after = parallel_state.get_pipeline_model_parallel_next_rank()
    anchor: torch.Tensor = _SendOn.apply(hidden, after, outbox)  # type: ignore[no-untyped-call]
    return anchor


def receive_final(anchor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The last stage's output (of ``shape``), on a stage before it; ``anchor``: :func:`send_on`'s."""
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    final: torch.Tensor = _Receive.apply(anchor, shape, last, _FINAL, None)  # type: ignore[no-untyped-call]
    return final


def send_final(hidden: torch.Tensor, stage: PipelineStage, outbox: Outbox) -> torch.Tensor:
    """The last stage's output, sent to every earlier stage; returned as it is (this stage back-propagates it)."""
    for rank in dist.get_process_group_ranks(stage.group)[:-1]:  # the group's ranks are the stages in order
        outbox.send(hidden, rank, _FINAL)
    return hidden


class _Receive(torch.autograd.Function):
    """A tensor from ``source``; backward sends its gradient back through ``outbox`` (``None``: ignores it)."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, shape: tuple[int, ...], source: int, tag: int, outbox: Outbox | None
    ) -> torch.Tensor:
        received = torch.empty(shape, dtype=anchor.dtype, device=anchor.device)
        dist.recv(received, src=source, tag=tag)
        ctx.source, ctx.outbox = source, outbox
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        if ctx.outbox is not None:
            ctx.outbox.send(grad, ctx.source, _GRADIENT)
        return torch.zeros((), dtype=grad.dtype, device=grad.device), None, None, None, None


class _SendOn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, after: int, outbox: Outbox) -> torch.Tensor:
        outbox.send(hidden, after, _OUTPUT)
        ctx.after, ctx.shape = after, hidden.shape
        return torch.zeros((), dtype=hidden.dtype, device=hidden.device)

    @staticmethod
    def backward(ctx: Any, _anchor_grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = torch.empty(ctx.shape, dtype=_anchor_grad.dtype, device=_anchor_grad.device)
        dist.recv(grad, src=ctx.after, tag=_GRADIENT)
        return grad, None, None


def gather_over_stages(tensors: list[torch.Tensor], stage: PipelineStage) -> list[torch.Tensor]:
    """Every stage's ``tensors`` (as many per stage, each of one shape: a MoE model's layers are all MoE, and
    the stages hold equally many), in stage order, on every stage (a collective). Each stage computes the same
    from them, so a stage's own get the gradient it computes."""
    joined: torch.Tensor = _GatherStages.apply(torch.stack(tensors), stage.index, stage.group)  # type: ignore[no-untyped-call]
    return list(joined.unbind(0))


class _GatherStages(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, stacked: torch.Tensor, index: int, group: Any) -> torch.Tensor:
        ctx.own = slice(index * len(stacked), (index + 1) * len(stacked))
        parts = [torch.empty_like(stacked) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, stacked.detach().contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[ctx.own], None, None
