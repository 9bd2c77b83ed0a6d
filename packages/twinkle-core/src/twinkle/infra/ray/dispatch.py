"""How a call on a component with several workers is dispatched and its results collected.

Ray mode runs a component like ``torchrun`` runs a script: a worker per rank of
its mesh (per share of the data, for components that set no
``one_worker_per_rank``), and every worker does every call (SPMD), so replicas
stay in step and collectives (a DDP gradient all-reduce, an FSDP gather in
``save``, a tensor- or pipeline-parallel layer's exchanges) find every rank.
Only the methods of :data:`BATCH_METHODS` differ, declaratively by name: they
take a batch, so each worker gets its data rank's contiguous share
(``DeviceMesh.get_slice``) of every per-sample argument, and the per-sample
parts of the results of one worker per share are put back together in batch
order (:func:`merge`). Any other method returns the first worker's result.
Pure Python, no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any

from twinkle.data_format import SampleResponse
from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.infra.device_mesh import DeviceMesh

# Twinkle's semantic API methods whose first argument is a batch (models' forward passes, samplers' sample).
BATCH_METHODS = frozenset(
    {"forward", "forward_only", "forward_backward", "calculate_loss", "forward_backward_targets", "sample"}
)


def worker_ranks(device_mesh: DeviceMesh | None, ranks_per_worker: int = 1, every_rank: bool = True) -> list[int]:
    """The mesh ranks that get an actor.

    ``every_rank`` (a component that joins ``torch.distributed`` over its mesh, as models do): every rank, as
    torchrun starts a process per rank; otherwise the first rank of each share of the data (tensor-parallel
    peers would only repeat its work). With several devices per worker (``DeviceGroup.gpus_per_worker``) a
    worker takes that many consecutive ranks, its tensor/context-parallel peers (e.g. one vLLM engine's
    tensor parallelism), so they must divide ``tp × cp``: peers share their data.
    """
    if device_mesh is None:
        return [0]
    inner = device_mesh.size("tp") * device_mesh.size("cp")
    if inner % ranks_per_worker:
        raise ConfigurationError(
            f"a worker with {ranks_per_worker} devices takes {ranks_per_worker} consecutive ranks of its mesh, "
            f"which must share their data: {ranks_per_worker} must divide tp_size*cp_size={inner}"
        )
    ranks = list(range(0, device_mesh.world_size, ranks_per_worker))
    return ranks if every_rank else [ranks[index] for index in data_leaders(device_mesh, ranks)]


def data_leaders(device_mesh: DeviceMesh | None, ranks: Sequence[int]) -> list[int]:
    """Indexes into ``ranks``: the first worker of each different share of a batch, in data order.

    Their results are merged; the other workers (tensor/pipeline/context-parallel or Ulysses peers, which
    saw the same samples) return the same ones.
    """
    if device_mesh is None:
        return [0]
    first: dict[int, int] = {}
    for index, rank in enumerate(ranks):
        first.setdefault(device_mesh.data_rank(rank), index)
    return [first[data_rank] for data_rank in sorted(first)]


def split_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], device_mesh: DeviceMesh, ranks: Sequence[int], where: str
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Per-worker ``(args, kwargs)``: every list/tuple argument is per-sample and is sliced; the rest is shared.

    All per-sample arguments must have the same length (the batch size), and
    each worker must get at least one sample.
    """
    lengths = {f"argument {i}": len(v) for i, v in enumerate(args) if _per_sample(v)}
    lengths.update({k: len(v) for k, v in kwargs.items() if _per_sample(v)})
    if not lengths:
        raise InvalidInputError(
            f"{where}: pass the batch as a list of samples to split it over {len(ranks)} data-parallel workers"
        )
    if len(set(lengths.values())) > 1:
        raise InvalidInputError(f"{where}: per-sample arguments differ in length: {lengths}")
    total = next(iter(lengths.values()))
    parts = len({device_mesh.data_rank(rank) for rank in ranks})
    if total < parts:
        raise InvalidInputError(f"{where}: {total} sample(s) cannot be split over {parts} data-parallel workers")
    shares = []
    for rank in ranks:
        part = device_mesh.get_slice(total, rank)
        shares.append(
            (
                tuple(v[part] if _per_sample(v) else v for v in args),
                {k: v[part] if _per_sample(v) else v for k, v in kwargs.items()},
            )
        )
    return shares


def merge(results: Sequence[Any]) -> Any:
    """Put the workers' results of a batch method back together; each worker saw a contiguous share of the batch.

    Lists and tuples (per-sample values: log-probs, sequences) concatenate in
    batch order; dicts and dataclasses merge field by field; anything else is
    taken from the first worker: a model reduces its scalars (loss, token
    counts, metrics) over its data-parallel ranks, so every worker holds the
    global figure. Samplers' responses are regrouped prompt-major
    (:meth:`SampleResponse.concatenate`), as one sampler would have ordered them.
    """
    first = results[0]
    if isinstance(first, SampleResponse):
        return SampleResponse.concatenate(results)
    if is_dataclass(first) and not isinstance(first, type):
        return replace(first, **{f.name: merge([getattr(r, f.name) for r in results]) for f in fields(first) if f.init})
    if isinstance(first, dict):
        return {key: merge([r[key] for r in results]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(item for r in results for item in r)
    return first


def _per_sample(value: Any) -> bool:
    return isinstance(value, (list, tuple))
