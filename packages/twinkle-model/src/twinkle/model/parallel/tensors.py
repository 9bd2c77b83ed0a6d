"""torch.distributed plumbing for data-parallel training under ``torchrun``.

The process group is created once from torchrun's environment (gloo on CPU,
nccl on CUDA). The helpers here are collectives: every rank must call them in
the same order, or the ranks that did wait for the others until the timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from twinkle.errors import InvalidInputError
from twinkle.infra import get_runtime, process_group_kwargs


def local_device(device: str | torch.device | None) -> torch.device:
    """``device``, or this process's accelerator: ``cuda:LOCAL_RANK`` under torchrun, else ``cuda`` / ``cpu``."""
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    runtime = get_runtime()
    return torch.device("cuda", runtime.local_rank) if runtime.is_torchrun else torch.device("cuda")


def init_process_group(device: torch.device) -> None:
    """Join the process group of torchrun (or of a component's Ray workers) unless already joined."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", **process_group_kwargs())


def own_group(groups: Sequence[Sequence[int]], rank: int) -> dist.ProcessGroup:
    """Create every one of ``groups`` (``new_group`` is collective: every rank creates each, in order); ``rank``'s."""
    own = None
    for ranks in groups:
        created = dist.new_group(list(ranks))
        if rank in ranks:
            own = created
    if own is None:
        raise InvalidInputError(f"rank {rank} is in none of the groups {list(groups)}")
    return own


def all_reduce_sum(
    values: Sequence[float], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Element-wise sums of ``values`` over the ranks of ``group`` (all) in float64, so token counts stay exact."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.tolist()


def all_reduce_max(
    values: Sequence[float], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Element-wise maxima of ``values`` over the ranks of ``group`` (all)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


@contextmanager
def all_or_none(device: torch.device) -> Iterator[None]:
    """Fail the block on every rank when it fails on any, with the failing ranks' messages.

    A rank that raised alone would leave the others blocked in their next
    collective (a gradient all-reduce) until the timeout; this way all ranks
    raise together and the gradients stay as they were everywhere. The block
    itself must not run collectives.
    """
    error: Exception | None = None
    try:
        yield
    except Exception as exc:  # re-raised below, after the other ranks know
        error = exc
    if all_reduce_sum([error is not None], device)[0] == 0:
        return
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = "; ".join(f"rank {rank}: {message}" for rank, message in enumerate(messages) if message)
    raise InvalidInputError(f"another data-parallel rank rejected its share of this call ({failed})")


def full_tensors(tree: Any) -> Any:
    """``tree`` (nested dicts/lists/tuples) with every sharded DTensor replaced by its full tensor.

    A collective under FSDP: every rank calls it on the same structure.
    """
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {key: full_tensors(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(full_tensors(value) for value in tree)
    return tree


def shard_optimizer_state(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A consolidated optimizer ``state`` (see :func:`full_tensors`) cut to the shards of ``optimizer``'s params.

    Per-parameter tensors (Adam's moments) become DTensors laid out like their
    FSDP parameter; everything else, and all of it in one process, is unchanged.
    """

    def fit(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor):
            return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
        return value

    return map_moments(state, optimizer, fit)


def map_moments(
    state: dict[str, Any], optimizer: torch.optim.Optimizer, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> dict[str, Any]:
    """``state`` (an ``optimizer.state_dict()``) with ``fn(value, param)`` applied to each per-element tensor.

    A per-element tensor (Adam's moments, a momentum buffer) has its parameter's number of dimensions, whole
    or as this rank holds it; scalars such as Adam's ``step`` stay as they are. The result has new dicts:
    ``state_dict()`` shares the optimizer's own.
    """
    params = [param for group in optimizer.param_groups for param in group["params"]]  # state_dict's numbering
    moments = {
        index: {
            key: fn(value, params[index])
            if torch.is_tensor(value) and value.dim() > 0 and value.dim() == params[index].dim()
            else value
            for key, value in values.items()
        }
        for index, values in state["state"].items()
    }
    return {**state, "state": moments}


class SyncedGradients:
    """Which gradients a plan has already finished across ranks, so finishing them again leaves them alone.

    A gradient counts as finished until backward accumulates into it again (its tensor or version changes);
    :func:`clip_finished` scales finished gradients in place and keeps them finished.
    """

    def __init__(self) -> None:
        self._marks: dict[int, tuple[int, int]] = {}  # param id -> (grad id, grad version) when finished

    def pending(self, param: torch.nn.Parameter) -> bool:
        grad = param.grad
        return grad is not None and self._marks.get(id(param)) != (id(grad), grad._version)

    def mark(self, params: Iterable[torch.nn.Parameter]) -> None:
        for param in params:
            if param.grad is not None:
                self._marks[id(param)] = (id(param.grad), param.grad._version)


def clip_finished(params: Sequence[torch.nn.Parameter], norm: float, max_norm: float, synced: SyncedGradients) -> None:
    """Scale finished gradients of total ``norm`` to at most ``max_norm``, as ``clip_grad_norm_`` does."""
    coefficient = min(max_norm / (norm + 1e-6), 1.0)
    for param in params:
        if param.grad is not None:
            param.grad.mul_(coefficient)
    synced.mark(params)
