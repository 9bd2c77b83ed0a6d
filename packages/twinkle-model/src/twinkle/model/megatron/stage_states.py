"""Checkpoints and optimizer states of a pipeline-parallel :class:`MegatronModel`, as one process numbers them.

Each stage holds its own decoder layers (under its local numbers, see
:meth:`.pipeline.PipelineStage.global_name`) and its optimizer numbers only its own parameters; saving joins
every stage's tensors and states under the model's names and numbering, and loading cuts them again, so a
checkpoint of any layout resumes any other.
"""

from __future__ import annotations

from itertools import accumulate, chain
from typing import Any

import torch
import torch.distributed as dist

from twinkle.model.megatron.pipeline import PipelineStage


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
