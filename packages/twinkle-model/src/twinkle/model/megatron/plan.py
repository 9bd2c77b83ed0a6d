"""Tensor parallelism (with data parallelism over it) for :class:`MegatronModel`, on torch.distributed.

Every rank of a tensor-parallel group sees the same samples and holds its shards of the weights
(megatron-core's layers do their own collectives in forward and backward); the data-parallel groups
(``dp_size``) see different samples. Gradients are finished here rather than by megatron's DDP (which
needs CUDA buffers): weights replicated but applied to each rank's own part (QK-norms on its heads,
LoRA ``A`` on column-parallel layers), marked ``partial_over_tensor_parallel``, add their partial
gradients over the tensor-parallel group; then every gradient is averaged over the
data-parallel group, as DDP would (``gradient_share`` turns the average back into the global batch's).
Norms count each shard once; checkpoints gather the shards whole and loads cut them again.
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
from twinkle.model.parallel import Parallelism
from twinkle.model.parallel import tensors as distributed
from twinkle.model.parallel.tensors import SyncedGradients, clip_finished, map_moments


class TensorParallel(Parallelism):
    """``tp_size`` ranks share each sample's work; ``dp_size`` groups of them share the batch."""

    def __init__(self, mesh: DeviceMesh | None, device: torch.device, seed: int = 0) -> None:
        if device.type != "cpu" and not torch.cuda.is_available():
            raise ConfigurationError(f"MegatronModel runs on cpu or cuda, got {device}")
        self.device = device
        self.mesh = mesh or DeviceMesh.from_sizes()
        others = {dim: self.mesh.size(dim) for dim in ("fsdp", "pp", "cp", "ep", "ulysses") if self.mesh.size(dim) > 1}
        if others:
            raise ConfigurationError(f"MegatronModel trains with tp_size and dp_size only; this mesh also has {others}")
        _join_process_group(self.mesh, device)
        self.rank = dist.get_rank()
        self.tp_size = self.mesh.size("tp")
        self.tp_rank = self.mesh.coords(self.rank)["tp"]
        self.data_world_size = self.mesh.data_world_size
        self.is_writer = self.rank == 0
        _initialize_megatron(self.mesh, self.rank, seed)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.synced = SyncedGradients()

    def sum(self, values: Sequence[float]) -> list[float]:
        return distributed.all_reduce_sum(values, self._comm_device, self.dp_group)

    def max(self, values: Sequence[float]) -> list[float]:
        return distributed.all_reduce_max(values, self._comm_device, self.dp_group)

    def all_or_none(self) -> Any:
        return distributed.all_or_none(self._comm_device)

    def sync_gradients(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> None:
        for param in params:
            grad = param.grad
            if grad is None or not self.synced.pending(param):
                continue
            # Replicated, but each rank used it on its own part (its heads, its rows): the gradient is partial.
            if self.tp_size > 1 and getattr(param, "partial_over_tensor_parallel", False):
                dist.all_reduce(grad, group=self.tp_group)
            if self.data_world_size > 1:
                dist.all_reduce(grad, group=self.dp_group)
                grad.div_(self.data_world_size)
        self.synced.mark(params)

    def clip_grad_norm(self, model: torch.nn.Module, params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        self.sync_gradients(model, params)
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for param in params:
            if param.grad is not None:
                squared = param.grad.detach().double().pow(2).sum().cpu()
                if is_sharded(param):
                    sharded += squared
                else:
                    replicated += squared
        if self.tp_size > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        norm = float((sharded + replicated).sqrt())
        clip_finished(params, norm, max_norm, self.synced)
        return norm

    def gathered(self, model: torch.nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
        params = {param.data_ptr(): param for param in model.parameters()}
        return {
            key: whole(value, params[value.data_ptr()], self.tp_group, self.tp_size)
            if torch.is_tensor(value) and value.data_ptr() in params
            else value
            for key, value in tensors.items()
        }

    def gathered_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        group, size = self.tp_group, self.tp_size
        return map_moments(optimizer.state_dict(), optimizer, lambda value, param: whole(value, param, group, size))

    def local_part(self, model: torch.nn.Module, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return local_part(full, param, self.tp_rank, self.tp_size)

    def local_optimizer_state(
        self, model: torch.nn.Module, state: dict[str, Any], optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        rank, size = self.tp_rank, self.tp_size
        return map_moments(state, optimizer, lambda value, param: local_part(value, param, rank, size))

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
    tp_size = mesh.size("tp")
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() != tp_size:
            raise ConfigurationError(
                f"this process already runs megatron-core with tp_size="
                f"{parallel_state.get_tensor_model_parallel_world_size()}; one MegatronModel layout per process"
            )
        return
    if mesh.world_size != dist.get_world_size():
        raise ConfigurationError(
            f"the device_mesh spans {mesh.world_size} ranks but this is one of {dist.get_world_size()} processes: "
            f"launch with torchrun --nproc_per_node {mesh.world_size}"
        )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    expected = mesh.group_ranks("tp", rank)
    actual = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    if sorted(actual) != expected:  # both put tensor-parallel ranks innermost; a change would corrupt shards
        raise ConfigurationError(f"megatron-core's tensor-parallel group {actual} differs from the mesh's {expected}")
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
