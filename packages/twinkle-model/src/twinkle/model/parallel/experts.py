"""Expert parallelism: each rank of a group holds ``1/ep`` of every MoE layer's experts; tokens travel to them.

transformers' MoE families (Qwen2/3-MoE, DeepSeek-V2, GLM-4-MoE, Mixtral)
keep a layer's experts as two fused tensors, ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, called with every token's chosen experts and their
weights. :class:`ExpertShard` replaces such a module with rank ``r``'s
contiguous block of experts. Its forward sends every (token, expert) pair to
the rank holding the expert (one all-to-all with uneven splits), runs its
experts on what it receives, sends the results back (the reverse
all-to-all) and adds them up with the router's weights, as the module did.
Each all-to-all back-propagates as the other, so the router and everything
before it get the gradients of the tokens' experts wherever they live.

FSDP2 shards the rest of the model and leaves each rank's experts alone.
They train like any weight (full-parameter training), or carry LoRA pairs
(PEFT's ``target_parameters``, which its ``"all-linear"`` adds on MoE
families) cut to the rank's experts: ``lora_A [r·E/ep, in]`` and
``lora_B [out, r·E/ep]``. Such expert-local tensors are described by an
:class:`ExpertSlice`: their gradients are complete on their rank once summed
over the ranks holding the same experts and scaled as FSDP2 scales the rest
(:meth:`ExpertParallel.sync_gradients`), and checkpoints gather them into the
one-process layout (and cut them back when loading). A back-end that keeps such
pairs outside the module (megatron's, see :class:`ExpertAdapters`) marks each
with its ``expert_slice``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from twinkle.errors import ConfigurationError
from twinkle.infra import DeviceMesh
from twinkle.model.parallel.tensors import SyncedGradients, own_group


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, output_counts: list[int], input_counts: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.counts, ctx.group = (output_counts, input_counts), group
        return _all_to_all_rows(rows, output_counts, input_counts, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_counts, input_counts = ctx.counts
        return _all_to_all_rows(grad, input_counts, output_counts, ctx.group), None, None, None


def _all_to_all_rows(
    rows: torch.Tensor, output_counts: list[int], input_counts: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``input_counts[i]`` consecutive rows go to group rank ``i``; ``output_counts[i]`` come from it."""
    output = rows.new_empty((sum(output_counts), *rows.shape[1:]))
    dist.all_to_all_single(output, rows.contiguous(), output_counts, input_counts, group=group)
    return output


def send_rows(
    rows: torch.Tensor, output_counts: list[int], input_counts: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """:func:`_all_to_all_rows` with autograd (the gradient goes back by the reverse exchange)."""
    output: torch.Tensor = _AllToAllRows.apply(rows, output_counts, input_counts, group)  # type: ignore[no-untyped-call]
    return output


class ExpertAdapters(Protocol):
    """LoRA updates of one MoE layer's experts for tokens tagged by adapter (an ``int`` each; -1: none).

    A token's tag travels with it to the rank holding its expert, so the adapters of a layer need not know
    the sender's batch rows.
    """

    def token_tags(self, tokens: int) -> torch.Tensor | None:
        """The tag of each of a forward's ``tokens`` flattened tokens (``None``: no adapter applies)."""
        ...

    def update(self, param: str, expert: int, x: torch.Tensor, tags: torch.Tensor) -> torch.Tensor | None:
        """The update of ``param``'s output (its expert ``expert``, in the module's own numbering) for rows ``x``."""
        ...


def swiglu_expert(experts: Any, expert: int, x: torch.Tensor, tags: torch.Tensor | None) -> torch.Tensor:
    """Expert ``expert`` of a fused experts module (``act_fn``, ``gate_up_proj``, ``down_proj``; optional
    :class:`ExpertAdapters` ``adapters``) on its rows ``x``, whose adapter ``tags`` are given when any apply."""

    def projected(param: str, rows: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(rows, getattr(experts, param)[expert])
        update = None if tags is None else experts.adapters.update(param, expert, rows, tags)
        return out if update is None else out + update

    gate, up = projected("gate_up_proj", x).chunk(2, dim=-1)
    return projected("down_proj", experts.act_fn(gate) * up)


def fused_experts(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every ``(name, module)`` of ``model`` that holds a layer's experts as fused ``[E, ...]`` tensors."""
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if {"gate_up_proj", "down_proj"} <= set(params) and params["gate_up_proj"].dim() == 3:
            yield name, module


def _check_fused(experts: Any) -> None:
    extra = sorted(set(dict(experts.named_parameters(recurse=False))) - {"gate_up_proj", "down_proj"})
    if extra or getattr(experts, "is_transposed", False):
        raise ConfigurationError(
            f"expert parallelism supports fused experts of gate_up_proj [E, 2I, H] and down_proj [E, H, I] only; "
            f"{type(experts).__name__} also has {extra or 'transposed weights'}"
        )


class ExpertShard(torch.nn.Module):
    """Experts ``first .. first + count - 1`` of a fused experts module, served to the whole group's tokens."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]
    gate_up_proj: torch.nn.Parameter
    down_proj: torch.nn.Parameter

    def __init__(self, experts: Any, rank: int, size: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        _check_fused(experts)
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.count = self.num_experts // size
        self.first = rank * self.count
        self.size, self.group, self.act_fn = size, group, experts.act_fn
        self.adapters: ExpertAdapters | None = getattr(experts, "adapters", None)
        own = slice(self.first, self.first + self.count)
        for param in ("gate_up_proj", "down_proj"):  # trained in full-parameter training, frozen under LoRA
            whole = experts.get_parameter(param)
            block = torch.nn.Parameter(whole.data[own].clone(), requires_grad=whole.requires_grad)
            block.__dict__.update(whole.__dict__)  # what a back-end marked on it (megatron's tensor-parallel cut)
            setattr(self, param, block)

    def forward(self, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor, top_k_weights_NK: torch.Tensor) -> Any:
        experts_A = top_k_index_NK.reshape(-1)  # one (token, expert) assignment per entry
        tokens_A = torch.arange(hidden_NH.shape[0], device=hidden_NH.device).repeat_interleave(top_k_index_NK.shape[1])
        weights_A = top_k_weights_NK.reshape(-1)
        kept = experts_A < self.num_experts  # an index of E is a router's "no expert"
        experts_A, tokens_A, weights_A = experts_A[kept], tokens_A[kept], weights_A[kept]
        owner_A = torch.div(experts_A, self.count, rounding_mode="floor")
        order = torch.argsort(owner_A, stable=True)
        experts_A, tokens_A, weights_A = experts_A[order], tokens_A[order], weights_A[order]
        sent = torch.bincount(owner_A, minlength=self.size)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        input_counts, output_counts = sent.tolist(), received.tolist()
        # Each assignment's expert travels with its token's adapter tag, if the layer has adapters.
        tags_N = self._token_tags(hidden_NH)
        labels = experts_A if tags_N is None else torch.stack([experts_A, tags_N[tokens_A]], dim=1)
        arrived = _all_to_all_rows(labels, output_counts, input_counts, self.group)
        experts_R, tags_R = (arrived, None) if tags_N is None else (arrived[:, 0], arrived[:, 1])
        arrived_RH = send_rows(hidden_NH[tokens_A], output_counts, input_counts, self.group)
        computed_RH = self._experts(arrived_RH, experts_R - self.first, tags_R)
        returned_AH = send_rows(computed_RH, input_counts, output_counts, self.group)
        weighted_AH = returned_AH * weights_A[:, None].to(returned_AH.dtype)
        return torch.zeros_like(hidden_NH).index_add_(0, tokens_A, weighted_AH.to(hidden_NH.dtype))

    def _token_tags(self, hidden_NH: torch.Tensor) -> torch.Tensor | None:
        """Each token's adapter tag when the layer has adapters: all -1 when none applies to this rank's rows
        (the other ranks' may, and the exchange is collective)."""
        if self.adapters is None:
            return None
        tokens, device = hidden_NH.shape[0], hidden_NH.device
        tags_N = self.adapters.token_tags(tokens)
        return torch.full((tokens,), -1, dtype=torch.long, device=device) if tags_N is None else tags_N

    def _experts(self, rows_RH: torch.Tensor, experts_R: torch.Tensor, tags_R: torch.Tensor | None) -> torch.Tensor:
        output_RH = rows_RH.new_zeros(rows_RH.shape[0], self.down_proj.shape[1])
        for expert in torch.unique(experts_R).tolist():
            picked = (experts_R == expert).nonzero().squeeze(1)
            tags = None if tags_R is None else tags_R[picked]
            output_RH = output_RH.index_copy(0, picked, swiglu_expert(self, expert, rows_RH[picked], tags))
        return output_RH


class ExpertParallel:
    """This rank's expert-parallel group: builds the groups (every rank, in the same order) and shards the experts."""

    def __init__(self, mesh: DeviceMesh, rank: int) -> None:
        self.size = mesh.ep_size
        self.rank_in_group = mesh.expert_rank(rank)
        groups = mesh.expert_groups()
        self.group = own_group(groups, rank)
        # The ranks holding the same experts: one per expert-parallel group of the same pipeline stage and
        # tensor-parallel rank (other stages hold other layers, other tensor-parallel ranks other parts of them).
        same_part: dict[tuple[int, int], list[list[int]]] = {}
        for group in groups:
            coords = mesh.coords(group[0])
            same_part.setdefault((coords["pp"], coords["tp"]), []).append(group)
        replicas = [[group[index] for group in part] for part in same_part.values() for index in range(self.size)]
        self.replica_group = own_group(replicas, rank) if len(replicas[0]) > 1 else None
        self.synced = SyncedGradients()
        self._slices: dict[int, ExpertSlice] | None = None  # fixed once the experts are sharded (see shard)

    def prepare(self, model: torch.nn.Module) -> None:
        """Refuse a model whose experts cannot be spread over the group, before anything is built."""
        found = list(fused_experts(model))
        if not found:
            raise ConfigurationError(
                f"ep_size={self.size}: {type(model).__name__} has no fused MoE experts to spread over the ranks"
            )
        for name, experts in found:
            _check_fused(experts)
            total = int(experts.get_parameter("gate_up_proj").shape[0])
            if total % self.size:
                raise ConfigurationError(
                    f"ep_size={self.size} must divide the number of experts per MoE layer ({total}, in {name})"
                )

    def shard(self, model: torch.nn.Module) -> None:
        """Replace every fused experts module by this rank's :class:`ExpertShard`, cutting their LoRA pairs too.

        Done when the model is wrapped, after its adapters were added: they were initialised as in one
        process (the same random draws), so every rank keeps its experts' part of the same weights.
        """
        for name, experts in list(fused_experts(model)):
            shard = ExpertShard(experts, self.rank_in_group, self.size, self.group)
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, shard)
        slices = self.expert_slices(model)  # the shards' own tensors, and their adapters' still whole
        wrapper: Any  # PEFT's ParamWrapper
        for wrapper in model.modules():
            owner = _adapted_shard(wrapper)
            if owner is None:
                continue
            wrapper.num_experts = owner.count  # PEFT's ParamWrapper reads its pairs per expert by it
            for part in (*wrapper.lora_A.values(), *wrapper.lora_B.values()):
                cut = slices[part.weight.data_ptr()].cut(part.weight.data)
                part.weight = torch.nn.Parameter(cut, requires_grad=part.weight.requires_grad)
        # The model is wrapped now (no adapter can be added any more): its expert-local tensors stay these.
        self._slices = self._find_slices(model)

    def expert_params(self, model: torch.nn.Module) -> set[torch.nn.Parameter]:
        """This rank's expert-local parameters (its experts and their LoRA pairs), which FSDP must leave alone."""
        slices = self.expert_slices(model)
        return {param for param in model.parameters() if param.data_ptr() in slices}

    def expert_slices(self, model: torch.nn.Module) -> dict[int, ExpertSlice]:
        """This rank's expert-local tensors (its experts' weights and their LoRA pairs), by ``data_ptr``."""
        found = self._slices if self._slices is not None else self._find_slices(model)
        # Pairs a back-end adds after the experts were sharded (and may remove) say so themselves.
        marked = {p.data_ptr(): p.expert_slice for p in model.parameters() if hasattr(p, "expert_slice")}
        return {**found, **marked} if marked else found

    def _find_slices(self, model: torch.nn.Module) -> dict[int, ExpertSlice]:
        slices: dict[int, ExpertSlice] = {}
        module: Any  # an ExpertShard, PEFT's ParamWrapper or any other module
        for module in model.modules():
            if isinstance(module, ExpertShard):
                for param in module.parameters(recurse=False):
                    slices[param.data_ptr()] = ExpertSlice(False, module.count, self.rank_in_group, self.size)
            shard = _adapted_shard(module)
            if shard is not None:  # a PEFT ParamWrapper on a shard's tensor: one pair per expert and adapter
                for lora_A, lora_B in zip(module.lora_A.values(), module.lora_B.values(), strict=True):
                    slices[lora_A.weight.data_ptr()] = ExpertSlice(False, shard.count, self.rank_in_group, self.size)
                    slices[lora_B.weight.data_ptr()] = ExpertSlice(True, shard.count, self.rank_in_group, self.size)
        return slices

    def sync_gradients(self, model: torch.nn.Module, params: Iterable[torch.nn.Parameter], world_size: int) -> None:
        """Make the expert-local gradients among ``params`` what FSDP2's would be.

        An expert's gradient already holds every token of its expert-parallel
        group (the all-to-all's backward brought them); ranks holding the same
        experts add theirs, and the sum is divided by the world size, as FSDP2
        averages. Gradients synced before (and not accumulated into since) are
        left alone, so calling it again is harmless.
        """
        slices = self.expert_slices(model)
        for param in params:
            if param.data_ptr() not in slices:
                continue
            if param.grad is None:  # no token reached this rank's experts: it still takes part
                param.grad = torch.zeros_like(param)
            if not self.synced.pending(param):
                continue
            if self.replica_group is not None:
                dist.all_reduce(param.grad, group=self.replica_group)
            param.grad.div_(world_size)
        self.synced.mark(params)

    def squared_norm(self, model: torch.nn.Module, params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
        """The squared L2 norm of every expert's gradient among ``params``, summed over the group's experts."""
        slices = self.expert_slices(model)
        local = [param.grad for param in params if param.data_ptr() in slices and param.grad is not None]
        total = torch.zeros((), dtype=torch.float64)
        for grad in local:
            total = total + grad.detach().double().pow(2).sum().cpu()
        dist.all_reduce(total, group=self.group)
        return total

    def gathered(self, model: torch.nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
        """``tensors`` (a state dict) with every expert-local tensor replaced by the whole group's (a collective)."""
        slices = self.expert_slices(model)
        return {
            key: slices[value.data_ptr()].gather(value, self.group)
            if torch.is_tensor(value) and value.data_ptr() in slices
            else value
            for key, value in tensors.items()
        }

    def gathered_like(self, model: torch.nn.Module, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """The whole group's ``local`` for ``param`` (its optimizer moments): a collective when expert-local."""
        expert_slice = self.expert_slices(model).get(param.data_ptr())
        return local if expert_slice is None else expert_slice.gather(local, self.group)

    def local_part(self, model: torch.nn.Module, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``full`` (a checkpoint's tensor) for ``param`` (``full`` itself if not expert-local)."""
        expert_slice = self.expert_slices(model).get(param.data_ptr())
        if expert_slice is None or full.shape == param.shape or full.dim() != param.dim():  # e.g. Adam's step
            return full
        return expert_slice.cut(full)


@dataclass(frozen=True)
class ExpertSlice:
    """How a rank's tensor holds its ``local_experts`` experts of the full one (rank ``rank`` of ``size``).

    Expert tensors ``[E/ep, ...]`` and LoRA A ``[r·E/ep, in]`` are contiguous row blocks; LoRA B
    ``[out, r·E/ep]`` has the expert as its minor column index (``experts_minor``).
    """

    experts_minor: bool
    local_experts: int
    rank: int
    size: int

    def gather(self, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.detach().contiguous(), group=group)
        if not self.experts_minor:
            return torch.cat(parts)
        out = local.shape[0]
        return torch.cat([part.view(out, -1, self.local_experts) for part in parts], dim=2).reshape(out, -1)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        if not self.experts_minor:
            return full.chunk(self.size)[self.rank].clone()
        out, experts = full.shape[0], self.local_experts * self.size
        own = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        return full.view(out, -1, experts)[:, :, own].reshape(out, -1).clone()


def _adapted_shard(module: Any) -> ExpertShard | None:
    """The :class:`ExpertShard` under a PEFT ``ParamWrapper`` (``lora_A``/``lora_B`` on one of its tensors)."""
    if not (hasattr(module, "lora_A") and hasattr(module, "parameter_name") and hasattr(module, "get_base_layer")):
        return None
    base = module.get_base_layer()
    return base if isinstance(base, ExpertShard) else None
