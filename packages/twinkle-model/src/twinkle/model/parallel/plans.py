"""How a model's computations run across processes: one process, or DDP / FSDP2 under ``torchrun``.

The model's ``DeviceMesh`` decides: ``dp_size=N`` replicates the model with
``DistributedDataParallel`` (gradients all-reduced), ``fsdp_size=N`` shards it
with FSDP2 (``fully_shard`` per decoder layer, then the root; with ``dp_size``
too, HSDP). :class:`Parallelism` is the one-process plan whose every method is
the identity, so the training code calls the same methods either way.

The model is wrapped on first use (``set_optimizer`` or the first forward):
adapters are added before, since FSDP2 replaces the parameters by sharded
ones (the adapters' :class:`TrainState` parameter lists are re-pointed to them).
Every forward goes through the wrapper (:class:`_Runner`), which is what makes
DDP sync gradients and FSDP2 gather the shards.

Both wrappers average gradients over the data-parallel ranks; each rank's loss
is its share of the global batch's loss (see :mod:`twinkle.model.parallel.global_batch`),
so :meth:`Parallelism.gradient_share` scales it by the number of ranks to turn that
average back into the sum. With ``ulysses_size`` the ranks of a Ulysses group
share their samples and split the tokens (:mod:`twinkle.model.parallel.ulysses`):
every rank of a group then holds the group's whole loss and figures, so shares
are counted per group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from twinkle.errors import ConfigurationError
from twinkle.infra import DeviceMesh, get_runtime
from twinkle.model.parallel import tensors as distributed
from twinkle.model.parallel.experts import ExpertParallel
from twinkle.model.parallel.tensors import clip_finished, full_tensors, map_moments, shard_optimizer_state
from twinkle.model.parallel.ulysses import SequenceParallel
from twinkle.model.train_state import TrainState
from twinkle.utils import get_logger

logger = get_logger(__name__)


class _Runner(torch.nn.Module):
    """Runs any computation on the model inside the DDP/FSDP wrapper's forward (hooks, gathers, gradient sync)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


class Parallelism:
    """One process holds the whole model and the whole batch: every method is the identity."""

    data_world_size = 1  # the ranks that see different samples
    is_writer = True  # the process that writes checkpoints
    sequence: SequenceParallel | None = None  # the Ulysses group this rank splits its samples' tokens with

    def prepare(self, model: torch.nn.Module) -> None:
        """Check that ``model`` can run this plan and set it up for it (before anything trains)."""

    def wrap(self, model: torch.nn.Module, states: Iterable[TrainState]) -> None:
        """Freeze the model's structure and wrap it for data parallelism (no-op here)."""

    def check_unwrapped(self, action: str) -> None:
        """Raise if the model is already wrapped, so ``action`` (adding an adapter) can no longer change it."""

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a computation on the model."""
        return fn(*args, **kwargs)

    def sum(self, values: Sequence[float]) -> list[float]:
        """Sums over the ranks that see different samples."""
        return list(values)

    def max(self, values: Sequence[float]) -> list[float]:
        """Maxima over the data-parallel ranks."""
        return list(values)

    def all_or_none(self) -> AbstractContextManager[None]:
        """A block that fails on every rank if it fails on one (it must not run collectives)."""
        return nullcontext()

    def gradient_share(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        """The loss to back-propagate for this rank's share, so synced gradients are the global batch's.

        Dividing by ``steps / ranks`` rather than multiplying keeps the one-process numbers bit for bit.
        """
        return loss / (gradient_accumulation_steps / self.data_world_size)

    def sync_gradients(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
        """Finish the gradients the wrapper does not sync in backward (expert-local ones), before a step."""

    def clip_grad_norm(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        """Clip ``params``' gradients to ``max_norm`` (L2, over every rank's share); the norm before clipping."""
        return float(full_tensors(torch.nn.utils.clip_grad_norm_(params, max_norm)))  # FSDP: a DTensor

    def gathered(self, model: torch.nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
        """A state dict of ``model`` whole, as one process holds it (a collective under torchrun)."""
        return dict(full_tensors(tensors))

    def gathered_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` whole, as one process holds it (a collective under torchrun)."""
        return dict(full_tensors(optimizer.state_dict()))

    def local_part(self, model: torch.nn.Module, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint's whole tensor ``full`` for ``param`` (a collective under torchrun)."""
        return full

    def local_optimizer_state(
        self, model: torch.nn.Module, state: dict[str, Any], optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """A whole optimizer ``state`` (see :meth:`gathered_optimizer_state`) cut to this rank's parameters."""
        return shard_optimizer_state(state, optimizer)


class DataParallel(Parallelism):
    """DDP (``dp_size``) or FSDP2 (``fsdp_size``, HSDP with both) over torchrun's processes."""

    def __init__(self, mesh: DeviceMesh, device: torch.device) -> None:
        distributed.init_process_group(device)
        self.mesh = mesh
        self.device = device
        self.data_world_size = mesh.data_world_size
        self.sharded = mesh.size("fsdp") > 1
        self.is_writer = dist.get_rank() == 0
        if mesh.ep_size > 1 and not self.sharded:
            raise ConfigurationError(
                f"expert parallelism (ep_size={mesh.ep_size}) shards the rest of the model with FSDP2: set fsdp_size"
            )
        self.sequence = SequenceParallel(mesh, dist.get_rank()) if mesh.ulysses_size > 1 else None
        self.experts = ExpertParallel(mesh, dist.get_rank()) if mesh.ep_size > 1 else None
        self._module: torch.nn.Module | None = None

    def prepare(self, model: torch.nn.Module) -> None:
        if self.sequence is not None:
            self.sequence.prepare(model)
        if self.experts is not None:
            self.experts.prepare(model)

    def wrap(self, model: torch.nn.Module, states: Iterable[TrainState]) -> None:
        if self._module is not None:
            return
        states = list(states)
        if len(states) > 1:
            raise ConfigurationError(
                f"data-parallel training trains one adapter (or the full model) per model, got {len(states)}: "
                f"{[s.name for s in states]}"
            )
        names = {id(param): name for name, param in model.named_parameters()}
        if self.experts is not None:
            self.experts.shard(model)
        runner = _Runner(model)
        self._module = self._shard(runner) if self.sharded else self._replicate(runner)
        current = dict(model.named_parameters())
        for state in states:  # FSDP2 registered new (sharded) parameters
            state.params = [current[names[id(param)]] for param in state.params]

    def check_unwrapped(self, action: str) -> None:
        if self._module is not None:
            raise ConfigurationError(
                f"{action} must happen before the model is first used (set_optimizer or a forward) under "
                "data parallelism: the model is wrapped for DDP/FSDP by then"
            )

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._module is None:
            raise RuntimeError("DataParallel.run before wrap(): the model must be wrapped first")
        output = self._module(fn, *args, **kwargs)
        if self.sharded and not torch.is_grad_enabled():
            # FSDP2 keeps the root's gathered parameters after forward for the backward that follows;
            # without one they would go stale at the next optimizer step.
            from torch.distributed.fsdp import FSDPModule

            if isinstance(self._module, FSDPModule):  # always, when sharded
                self._module.reshard()
        return output

    def sum(self, values: Sequence[float]) -> list[float]:
        if self.sequence is not None and not self.sequence.is_leader:  # its group's leader counts the group
            values = [0.0] * len(values)
        return distributed.all_reduce_sum(values, self._comm_device)

    def max(self, values: Sequence[float]) -> list[float]:
        return distributed.all_reduce_max(values, self._comm_device)

    def all_or_none(self) -> AbstractContextManager[None]:
        return distributed.all_or_none(self._comm_device)

    def sync_gradients(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
        if self.experts is not None:
            self.experts.sync_gradients(model, params, self.mesh.world_size)

    def clip_grad_norm(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        if self.experts is None:
            return super().clip_grad_norm(model, params, max_norm)
        self.sync_gradients(model, params)
        experts = self.experts.expert_params(model)
        shared = [param.grad for param in params if param not in experts and param.grad is not None]
        squared = self.experts.squared_norm(model, params)
        if shared:
            squared = squared + float(full_tensors(torch.nn.utils.get_total_norm(shared))) ** 2
        norm = float(squared.sqrt())
        clip_finished(params, norm, max_norm, self.experts.synced)
        return norm

    def gathered(self, model: torch.nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
        whole = super().gathered(model, tensors)
        return self.experts.gathered(model, whole) if self.experts is not None else whole

    def gathered_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = optimizer.state_dict()
        experts = self.experts
        if experts is not None:  # an expert parameter's moments are gathered as the parameter is
            state = map_moments(state, optimizer, lambda value, param: experts.gathered_like(model, param, value))
        return dict(full_tensors(state))

    def local_part(self, model: torch.nn.Module, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor):  # sharded by FSDP2, laid out like the parameter
            return distribute_tensor(full.to(param.device), param.device_mesh, param.placements)
        return self.experts.local_part(model, param, full) if self.experts is not None else full

    def local_optimizer_state(
        self, model: torch.nn.Module, state: dict[str, Any], optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        experts = self.experts
        if experts is not None:
            state = map_moments(state, optimizer, lambda value, param: experts.local_part(model, param, value))
        return shard_optimizer_state(state, optimizer)

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _replicate(self, runner: _Runner) -> torch.nn.Module:
        if not any(p.requires_grad for p in runner.parameters()):
            return runner  # nothing trains (e.g. a reference model): no gradients to sync
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(runner, device_ids=device_ids)

    def _shard(self, runner: _Runner) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dp, fsdp = self.mesh.size("dp"), self.mesh.size("fsdp")
        torch_mesh = init_device_mesh(self.device.type, (dp, fsdp), mesh_dim_names=("dp", "fsdp"))
        shard_mesh = torch_mesh if dp > 1 else torch_mesh["fsdp"]  # a 2-D mesh makes fully_shard HSDP
        # Each rank's experts are its own (expert parallelism): FSDP2 leaves them where they are.
        ignored = self.experts.expert_params(runner) if self.experts is not None else set()
        for param in runner.parameters():  # each rank keeps its shard of rank 0's (random) initial weights
            if param.requires_grad and param not in ignored:
                dist.broadcast(param.data, src=0)
        layers = list(_decoder_layers(runner.model))
        if not layers:
            raise ConfigurationError(
                f"FSDP needs the model's decoder layer class (transformers' _no_split_modules); "
                f"{type(runner.model).__name__} declares none"
            )
        for layer in layers:  # frozen base and trainable LoRA weights may share a layer: FSDP2 allows it
            fully_shard(layer, mesh=shard_mesh, ignored_params=ignored)
        fully_shard(runner, mesh=shard_mesh, ignored_params=ignored)  # makes runner itself an FSDPModule
        return runner


def _decoder_layers(model: Any) -> Iterator[torch.nn.Module]:  # a transformers model, possibly PEFT-wrapped
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layer_classes = set(getattr(inner, "_no_split_modules", None) or ())
    return (module for module in model.modules() if type(module).__name__ in layer_classes)


def parallelism_for(mesh: DeviceMesh | None, device: torch.device, model_cls: type) -> Parallelism:
    """The plan for a ``model_cls`` model on ``mesh`` (``None`` or one rank: one process)."""
    runtime = get_runtime()
    name = model_cls.__name__
    if mesh is None and runtime.world_size > 1:
        logger.warning(
            "%s has no device_mesh but this is one of %d processes: each trains alone, without syncing gradients "
            "(pass device_mesh=DeviceMesh.from_sizes(dp_size=...) or initialize(global_device_mesh=...))",
            name,
            runtime.world_size,
        )
    if mesh is None or mesh.world_size == 1:
        return Parallelism()
    if not getattr(model_cls, "supports_data_parallel", False):
        raise ConfigurationError(f"{name} runs in one process; give it no device_mesh (or a one-rank one)")
    others = {dim: mesh.size(dim) for dim in ("tp", "pp", "cp") if mesh.size(dim) > 1}
    if others:
        raise ConfigurationError(
            f"{name} trains with dp_size/fsdp_size/ep_size/ulysses_size only; this mesh also has {others}"
        )
    if runtime.world_size != mesh.world_size:
        raise ConfigurationError(
            f"the device_mesh spans {mesh.world_size} ranks but this is one of {runtime.world_size} processes: "
            f"launch with torchrun --nproc_per_node {mesh.world_size}"
        )
    return DataParallel(mesh, device)
