"""How a call on a component with several data-parallel workers is dispatched and its results collected.

Ray mode runs a component like ``torchrun`` runs a script: every worker does
every call (SPMD), so replicas stay in step and collectives (a DDP gradient
all-reduce, an FSDP gather in ``save``) find every rank. Only the methods of
:data:`BATCH_METHODS` differ, declaratively by name: they take a batch, so
each worker gets its contiguous share (``DeviceMesh.get_slice``) of every
per-sample argument, and the per-sample parts of the results are put back
together in batch order (:func:`merge`). Any other method returns the first
worker's result. Pure Python, no Ray.
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


def worker_ranks(device_mesh: DeviceMesh | None) -> list[int]:
    """One mesh rank per data-parallel worker (its tp/cp/pp coordinates 0): the ranks that get actors."""
    if device_mesh is None:
        return [0]
    if device_mesh.ulysses_size > 1:
        raise ConfigurationError(
            f"ulysses_size={device_mesh.ulysses_size}: sequence parallelism runs under torchrun, not on Ray workers"
        )
    fsdp = device_mesh.size("fsdp")
    return [device_mesh.rank_of(dp=d // fsdp, fsdp=d % fsdp) for d in range(device_mesh.data_world_size)]


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
    if total < len(ranks):
        raise InvalidInputError(f"{where}: {total} sample(s) cannot be split over {len(ranks)} data-parallel workers")
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
