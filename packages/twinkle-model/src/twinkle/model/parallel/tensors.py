"""torch.distributed plumbing for data-parallel training under ``torchrun``.

The process group is created once from torchrun's environment (gloo on CPU,
nccl on CUDA). The helpers here are collectives: every rank must call them in
the same order, or the ranks that did wait for the others until the timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
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
    params = [param for group in optimizer.param_groups for param in group["params"]]  # state_dict's numbering

    def fit(value: Any, param: torch.Tensor) -> Any:
        if isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape:
            return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
        return value

    per_param = {}
    for index, values in state["state"].items():
        per_param[index] = {key: fit(value, params[index]) for key, value in values.items()}
    return {**state, "state": per_param}
