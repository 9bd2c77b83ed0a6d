"""Tensor and pipeline parallelism (with data parallelism over them) for :class:`MegatronModel`, on torch.distributed.

Every rank of a tensor-parallel group sees the same samples and holds its shards of the weights
(megatron-core's layers do their own collectives in forward and backward); the data-parallel groups
(``dp_size``) see different samples. Gradients are finished here rather than by megatron's DDP (which
needs CUDA buffers): weights replicated but applied to each rank's own part (QK-norms on its heads,
LoRA ``A`` on column-parallel layers), marked ``partial_over_tensor_parallel``, add their partial
gradients over the tensor-parallel group; then every gradient is averaged over the
data-parallel group, as DDP would (``gradient_share`` turns the average back into the global batch's).
Norms count each shard once; checkpoints gather the shards whole and loads cut them again.

Pipeline stages (``pp_size``, see :mod:`.pipeline`) see the same samples too: each holds its own layers,
whose norms add over the stages; the weights every stage holds (the word embeddings) get their gradient
summed over the stages and count once. Checkpoints join the stages' layers under the model's layer
numbers, and optimizer states are numbered as one process numbers them, so any layout resumes any other.

Expert parallelism (``ep_size``, over the data-parallel ranks, MoE models) is
:class:`twinkle.model.parallel.experts.ExpertParallel`'s, as under FSDP2: each rank keeps its block of
every layer's experts (and of their LoRA pairs), tokens travel to them by all-to-all, expert gradients are
summed over the ranks holding the same experts and scaled as the rest, and checkpoints gather the experts
whole. With ``tp_size`` too, each expert-parallel group is one tensor-parallel rank's: it exchanges that
rank's parts of the experts, and the tensor-parallel sum after the experts adds the parts up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from twinkle.errors import ConfigurationError
from twinkle.infra import DeviceMesh
from twinkle.model.megatron.conversion import is_sharded, local_part, whole
from twinkle.model.megatron.pipeline import PipelineStage
from twinkle.model.megatron.stage_states import (
    optimizer_names,
    stage_optimizer_state,
    stitched_optimizer_state,
    union_over_stages,
)
from twinkle.model.parallel import Parallelism
from twinkle.model.parallel import tensors as distributed
from twinkle.model.parallel.experts import ExpertParallel
from twinkle.model.parallel.tensors import SyncedGradients, clip_finished, map_moments


class MegatronParallel(Parallelism):
    """``tp_size`` ranks share each layer's work, ``pp_size`` stages the layers; ``dp_size`` groups share the batch."""

    def __init__(self, mesh: DeviceMesh | None, device: torch.device, num_layers: int, seed: int = 0) -> None:
        if device.type != "cpu" and not torch.cuda.is_available():
            raise ConfigurationError(f"MegatronModel runs on cpu or cuda, got {device}")
        self.device = device
        self.mesh = mesh or DeviceMesh.from_sizes()
        others = {dim: self.mesh.size(dim) for dim in ("fsdp", "cp", "ulysses") if self.mesh.size(dim) > 1}
        if others:
            raise ConfigurationError(
                f"MegatronModel trains with tp_size, pp_size, ep_size and dp_size only; this mesh also has {others}"
            )
        _join_process_group(self.mesh, device)
        self.rank = dist.get_rank()
        self.tp_size = self.mesh.size("tp")
        self.tp_rank = self.mesh.coords(self.rank)["tp"]
        self.data_world_size = self.mesh.data_world_size
        self.is_writer = self.rank == 0
        _initialize_megatron(self.mesh, self.rank, seed)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.stage = PipelineStage.of_this_rank(num_layers)
        self.experts = ExpertParallel(self.mesh, self.rank) if self.mesh.size("ep") > 1 else None
        self.synced = SyncedGradients()

    def shard_experts(self, model: torch.nn.Module) -> None:
        """Keep this rank's block of every MoE layer's experts (refusing a model whose experts do not divide)."""
        if self.experts is not None:
            self.experts.prepare(model)
            self.experts.shard(model)

    def _expert_params(self, model: torch.nn.Module) -> set[torch.nn.Parameter]:
        return set() if self.experts is None else self.experts.expert_params(model)

    def sum(self, values: Sequence[float]) -> list[float]:
        return distributed.all_reduce_sum(values, self._comm_device, self.dp_group)

    def max(self, values: Sequence[float]) -> list[float]:
        return distributed.all_reduce_max(values, self._comm_device, self.dp_group)

    def all_or_none(self) -> Any:
        return distributed.all_or_none(self._comm_device)

    def sync_gradients(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
        self._sum_over_stages(params)
        pending = [param for param in params if param.grad is not None and self.synced.pending(param)]
        for param in pending:  # replicated, but each rank used it on its own part (heads, rows, experts' slices)
            if self.tp_size > 1 and getattr(param, "partial_over_tensor_parallel", False):
                dist.all_reduce(param.grad, group=self.tp_group)
        experts = self._expert_params(model)
        if self.experts is not None:  # summed over the ranks holding the same experts, scaled as the rest
            self.experts.sync_gradients(model, [param for param in params if param in experts], self.data_world_size)
        for param in pending:
            if param not in experts and self.data_world_size > 1:
                dist.all_reduce(param.grad, group=self.dp_group)
                param.grad.div_(self.data_world_size)  # type: ignore[union-attr]
        self.synced.mark(params)

    def _sum_over_stages(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Add up the stages' gradients of the weights every stage holds (each stage's part: the embeddings' on
        the first, each stage's vocabulary rows of the output layer)."""
        if self.stage.size == 1:
            return
        shared = [param for param in params if getattr(param, "replicated_over_pipeline", False)]
        # Whether each is pending, as any stage sees it: every stage must join the same all-reduces.
        pending = torch.tensor([self.synced.pending(param) for param in shared], dtype=torch.int32)
        dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=self.stage.group)
        for param, flag in zip(shared, pending.tolist(), strict=True):
            if flag:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=self.stage.group)

    def clip_grad_norm(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        self.sync_gradients(model, params)
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        experts = self._expert_params(model)
        if self.experts is not None:  # each expert once: summed over the expert-parallel group (shards: and tp's)
            mine = [param for param in params if param in experts]
            sharded += self.experts.squared_norm(model, [param for param in mine if is_sharded(param)])
            replicated += self.experts.squared_norm(model, [param for param in mine if not is_sharded(param)])
        for param in params:
            if param.grad is None or param in experts:
                continue
            if getattr(param, "replicated_over_pipeline", False) and not self.stage.is_first:
                continue  # a weight every stage holds counts once
            squared = param.grad.detach().double().pow(2).sum().cpu()
            if is_sharded(param):
                sharded += squared
            else:
                replicated += squared
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        total = sharded + replicated
        if self.stage.size > 1:
            dist.all_reduce(total, group=self.stage.group)
        norm = float(total.sqrt())
        clip_finished(params, norm, max_norm, self.synced)
        if self.experts is not None:  # scaled in place, the expert gradients are still finished
            self.experts.synced.mark(params)
        return norm

    def gathered(self, model: torch.nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
        params = {param.data_ptr(): param for param in model.parameters()}
        joined = {
            self.stage.global_name(key): self._whole(model, value, params[value.data_ptr()])
            if torch.is_tensor(value) and value.data_ptr() in params
            else value
            for key, value in tensors.items()
        }
        return joined if self.stage.size == 1 else union_over_stages(joined, self.stage)

    def _whole(self, model: torch.nn.Module, local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The whole of ``param``'s ``local`` part (or of its optimizer moment): joined over the tensor-parallel
        group, then over the expert-parallel one (collectives)."""
        joined = whole(local, param, self.tp_group, self.tp_size)
        return joined if self.experts is None else self.experts.gathered_like(model, param, joined)

    def gathered_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = map_moments(optimizer.state_dict(), optimizer, lambda value, param: self._whole(model, value, param))
        if self.stage.size == 1:
            return state
        return stitched_optimizer_state(state, optimizer_names(model, optimizer, self.stage), self.stage)

    def local_part(self, model: torch.nn.Module, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if self.experts is not None:
            full = self.experts.local_part(model, param, full)
        return local_part(full, param, self.tp_rank, self.tp_size)

    def local_optimizer_state(
        self, model: torch.nn.Module, state: dict[str, Any], optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        if self.stage.size > 1:
            state = stage_optimizer_state(state, optimizer_names(model, optimizer, self.stage), self.stage)
        return map_moments(state, optimizer, lambda value, param: self.local_part(model, param, value))

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def _join_process_group(mesh: DeviceMesh, device: torch.device) -> None:
    """torchrun's process group, or a one-process one (megatron-core's layers always take a group)."""
    if dist.is_initialized():
        return
    if mesh.world_size > 1:
        distributed.init_process_group(device)
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]


def _initialize_megatron(mesh: DeviceMesh, rank: int, seed: int) -> None:
    """megatron-core's groups for this mesh (once per process), checked against the mesh's own."""
    tp_size, pp_size = mesh.size("tp"), mesh.size("pp")
    if parallel_state.model_parallel_is_initialized():
        running = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if running != (tp_size, pp_size):
            raise ConfigurationError(
                f"this process already runs megatron-core with tp_size={running[0]}, pp_size={running[1]}; one "
                "MegatronModel layout per process"
            )
        return
    if mesh.world_size != dist.get_world_size():
        raise ConfigurationError(
            f"the device_mesh spans {mesh.world_size} ranks but this is one of {dist.get_world_size()} processes: "
            f"launch with torchrun --nproc_per_node {mesh.world_size}"
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size)
    # Both put tensor-parallel ranks innermost and pipeline stages outermost; a change would corrupt shards.
    for dim, group in (
        ("tp", parallel_state.get_tensor_model_parallel_group()),
        ("pp", parallel_state.get_pipeline_model_parallel_group()),
    ):
        expected, actual = mesh.group_ranks(dim, rank), dist.get_process_group_ranks(group)
        if sorted(actual) != expected:
            raise ConfigurationError(f"megatron-core's {dim} group {actual} differs from the mesh's {expected}")
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
