"""Pipeline parallelism for :class:`MegatronModel`: each stage holds a contiguous run of decoder layers.

megatron-core builds the layers of this rank's pipeline stage (``TransformerBlock`` asks
``parallel_state``); its schedules and its embedding-group all-reduce need CUDA, so the hand-offs are
our own autograd functions on torch.distributed point-to-point and broadcast, which any backend has:

- a stage after the first receives the previous stage's hidden states (:func:`receive_hidden`) and
  sends their gradient back in backward;
- the last stage applies the final norm and *broadcasts* the result to every stage
  (:func:`hand_on`), so every stage computes the same output layer, log-probs and losses as one
  process would: the pass engine, losses and metrics run unchanged on every rank;
- an earlier stage sends its output on and gets that broadcast; in backward it ignores the gradient of
  the broadcast copy (the last stage back-propagates the same one) and receives its output's gradient
  from the next stage;
- what the loss needs from every stage's layers (the routers' logits, for the load-balancing loss) is
  gathered onto every stage (:func:`gather_over_stages`); each stage back-propagates its own part.

The word embeddings (and an untied output layer) are replicated on every stage; only the first
stage's copies get gradients (the others use them detached), which are then summed over the pipeline
group, so every copy steps the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate, chain
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


def receive_hidden(like: torch.Tensor) -> torch.Tensor:
    """The previous stage's output (``like``'s shape and dtype); backward sends its gradient back."""
    anchor = torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)  # puts it in the graph
    source = parallel_state.get_pipeline_model_parallel_prev_rank()
    received: torch.Tensor = _Receive.apply(anchor, tuple(like.shape), source)  # type: ignore[no-untyped-call]
    return received


def hand_on(hidden: torch.Tensor, stage: PipelineStage) -> torch.Tensor:
    """The last stage's output on every stage: sent on from earlier stages, broadcast from the last."""
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    if stage.is_last:
        dist.broadcast(hidden.detach().contiguous(), src=last, group=stage.group)
        return hidden
    after = parallel_state.get_pipeline_model_parallel_next_rank()
    final: torch.Tensor = _HandOn.apply(hidden, after, last, stage.group)  # type: ignore[no-untyped-call]
    return final


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, shape: tuple[int, ...], source: int) -> torch.Tensor:
        received = torch.empty(shape, dtype=anchor.dtype, device=anchor.device)
        dist.recv(received, src=source)
        ctx.source = source
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        dist.send(grad.contiguous(), dst=ctx.source)
        return torch.zeros((), dtype=grad.dtype, device=grad.device), None, None


class _HandOn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, after: int, last: int, group: Any) -> torch.Tensor:
        dist.send(hidden.detach().contiguous(), dst=after)
        final = torch.empty_like(hidden)
        dist.broadcast(final, src=last, group=group)
        ctx.after = after
        ctx.save_for_backward(hidden)
        return final

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (hidden,) = ctx.saved_tensors
        received = torch.empty_like(hidden)
        dist.recv(received, src=ctx.after)
        return received, None, None, None


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


def _gather_objects(value: Any, stage: PipelineStage) -> list[Any]:
    """Every stage's ``value``, in stage order (a collective over the pipeline group)."""
    values: list[Any] = [None] * stage.size
    dist.all_gather_object(values, value, group=stage.group)
    return values


def union_over_stages(tensors: dict[str, Any], stage: PipelineStage) -> dict[str, Any]:
    """Every stage's named tensors in one dict (on the CPU), stage by stage; replicated names keep the first's."""
    local = {key: value.detach().cpu() if torch.is_tensor(value) else value for key, value in tensors.items()}
    union: dict[str, Any] = {}
    for part in _gather_objects(local, stage):
        for key, value in part.items():
            union.setdefault(key, value)
    return union


def names_over_stages(names: list[str], stage: PipelineStage) -> list[str]:
    """Every stage's names in stage order, each once: the order one process lists them in."""
    return _model_order([[names] for names in _gather_objects(names, stage)])[0]


def optimizer_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer, stage: PipelineStage) -> list[list[str]]:
    """Each parameter group's parameters by their model-wide names, in the optimizer's order."""
    names = {id(param): stage.global_name(name) for name, param in model.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def stitched_optimizer_state(state: dict[str, Any], names: list[list[str]], stage: PipelineStage) -> dict[str, Any]:
    """Every stage's optimizer state (a ``state_dict()``, tensors whole) numbered as one process numbers it."""
    parts = _gather_objects((names, state), stage)
    order = _model_order([part_names for part_names, _ in parts])
    index = {name: number for number, name in enumerate(chain.from_iterable(order))}
    moments: dict[int, Any] = {}
    for part_names, part_state in parts:
        flat = list(chain.from_iterable(part_names))
        for local, values in part_state["state"].items():
            moments.setdefault(index[flat[local]], values)  # replicated weights: the first stage's
    groups = [
        {**group, "params": [index[name] for name in order[number]]}
        for number, group in enumerate(state["param_groups"])
    ]
    return {"state": moments, "param_groups": groups}


def stage_optimizer_state(state: dict[str, Any], names: list[list[str]], stage: PipelineStage) -> dict[str, Any]:
    """The inverse of :func:`stitched_optimizer_state`: this stage's entries, numbered as its optimizer does."""
    order = _model_order(_gather_objects(names, stage))
    index = {name: number for number, name in enumerate(chain.from_iterable(order))}
    flat = list(chain.from_iterable(names))
    moments = {local: state["state"][index[name]] for local, name in enumerate(flat) if index[name] in state["state"]}
    starts = [0, *accumulate(len(group) for group in names)]
    groups = [
        {**group, "params": list(range(starts[number], starts[number + 1]))}
        for number, group in enumerate(state["param_groups"])
    ]
    return {"state": moments, "param_groups": groups}


def _model_order(everyone: list[list[list[str]]]) -> list[list[str]]:
    """Each parameter group's names over every stage (stage by stage, each once): one process's order."""
    return [
        list(dict.fromkeys(chain.from_iterable(names[group] for names in everyone)))
        for group in range(len(everyone[0]))
    ]
