"""Under torchrun: MegatronModel trains in each of :data:`LAYOUTS` (TP, PP, DP; on MoE TP, EP, and EP with each).

    torchrun --nproc_per_node 2 integration-tests/megatron_training.py tp,pp,ep-moe,tenants,schedule-1f1b OUTPUT_DIR
    torchrun --nproc_per_node 4 integration-tests/megatron_training.py tp-ep-moe,pp-ep-moe OUTPUT_DIR

Every weight, then a LoRA adapter (PEFT's "all-linear", which on the MoE builtin adapts the attention, the
fused experts and the router; the pipeline layout adds the output layer),
trains for 5 steps in float64 (a checkpoint with the optimizer after step 2, the final weights after step
5); in the :data:`RESUMED` layouts a fresh model then resumes from the step-2 checkpoint for the last 3
steps. Rank 0 prints ``RESULT`` and the JSON of each layout's and kind's losses, gradient norms and paths;
the same runs in one process are :func:`run` with no mesh. :data:`TENANT_LAYOUTS`: :func:`train_tenants`;
:data:`ROUTER_LAYOUTS`: :func:`train_router_loss`; both recompute every decoder layer in backward
(``gradient_checkpointing``) here and keep their activations in the one-process runs they are compared with.
:data:`SCHEDULE_LAYOUTS`: :func:`train_schedule` with each pipeline schedule; ``vocab-parallel``:
:func:`vocab_parallel_errors`.
test_megatron_parallel.py runs both and compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from conversations import encoded_conversations  # beside this script
from peft import LoraConfig
from resumed_training import steps, train_save_resume

import twinkle
from twinkle import DeviceMesh
from twinkle.loss import CrossEntropyLoss
from twinkle.model import AdapterRequest
from twinkle.model.megatron import MegatronModel, MultiLoraMegatronModel
from twinkle.model.megatron.head import vocab_parallel_logps

MODEL = "builtin://qwen3-tiny"
MOE_MODEL = "builtin://qwen3-moe-tiny"
ALL_LINEAR = "all-linear"  # PEFT's: on the MoE builtin, the attention, the fused experts and the router
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
WITH_HEAD = (*ATTENTION, "gate_proj", "up_proj", "down_proj", "lm_head")  # the (tied) output layer too
# layout -> the model, its mesh's sizes (its world: tp × pp × dp) and the adapter's target_modules;
# "-moe" layouts train the MoE builtin.
LAYOUTS = {
    "tp": (MODEL, {"tp": 2}, ALL_LINEAR),
    "pp": (MODEL, {"pp": 2}, WITH_HEAD),  # every stage runs the output layer: its pair as the embeddings
    "dp": (MODEL, {"dp": 2}, ALL_LINEAR),
    "tp-moe": (MOE_MODEL, {"tp": 2}, ALL_LINEAR),
    "ep-moe": (MOE_MODEL, {"ep": 2, "dp": 2}, ALL_LINEAR),  # experts (and their pairs) split over the data ranks
    # four ranks: each expert-parallel group (two data ranks) is one tensor-parallel rank's, with its parts
    "tp-ep-moe": (MOE_MODEL, {"tp": 2, "ep": 2, "dp": 2}, ALL_LINEAR),
    "pp-ep-moe": (MOE_MODEL, {"pp": 2, "ep": 2, "dp": 2}, ALL_LINEAR),  # ... one pipeline stage's
}


def world_of(layout: str) -> int:
    """How many processes ``layout`` takes (expert parallelism is over the data-parallel ranks)."""
    sizes = LAYOUTS[layout][1]
    return sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("dp", 1)


# The layouts whose checkpoints are cut differently from one process's (or another layout's): these resume.
RESUMED = ("tp", "pp", "ep-moe", "tp-ep-moe", "pp-ep-moe")
KINDS = ("full", "lora")
# Tenants' adapters in shared passes on the MoE builtin (MultiLoraMegatronModel): name -> (rank, target_modules).
TENANTS = {"all": (4, ALL_LINEAR), "attention": (2, (*ATTENTION, "lm_head"))}
ROUTER_LOSS = {"output_router_logits": True, "router_aux_loss_coef": 0.5}  # the router's load-balancing loss
# Its layouts: each tensor-parallel rank computes it whole; each pipeline stage from every stage's routers.
ROUTER_LAYOUTS = {"router-tp": ("tp",), "router-pp": ("pp",)}
# The tenants' layouts: at tp_size=2, and with their expert pairs split with the experts (ep_size=2, dp_size=2).
TENANT_LAYOUTS = {"tenants": ("tp",), "tenants-ep": ("ep", "dp")}
# pp_size=2 with each pipeline schedule: :func:`train_schedule`.
SCHEDULE_LAYOUTS = {"schedule-1f1b": "1f1b", "schedule-sequential": "sequential"}
TRIGGER = 4999  # a micro-batch holding this token makes RaisingLoss raise


class RaisingLoss(CrossEntropyLoss):
    """Cross-entropy, except on a micro-batch that holds the :data:`TRIGGER` token: then it raises."""

    def __call__(self, inputs: Any, outputs: Any, normalizer: Any = None, **loss_inputs: Any) -> Any:
        if bool((inputs["input_ids"] == TRIGGER).any()):
            raise RuntimeError("tenant loss exploded")
        return super().__call__(inputs, outputs, normalizer, **loss_inputs)


def label(targets: str | tuple[str, ...]) -> str:
    """A short name of an adapter's ``target_modules``."""
    return targets if isinstance(targets, str) else "+".join(targets)


def make_model(
    mesh: DeviceMesh | None, lora: bool, model_id: str = MODEL, targets: str | tuple[str, ...] = ALL_LINEAR
) -> MegatronModel:
    model = MegatronModel(model_id, device="cpu", dtype=torch.float64, device_mesh=mesh)
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets if isinstance(targets, str) else list(targets))
        model.add_adapter_to_model("default", config, seed=0)
    model.set_optimizer("AdamW", lr=1e-2 if lora else 1e-3)
    return model


def run(
    mesh: DeviceMesh | None,
    lora: bool,
    output_dir: Path,
    model_id: str = MODEL,
    targets: str | tuple[str, ...] = ALL_LINEAR,
    resume: bool = True,
) -> dict[str, Any]:
    """5 steps with a checkpoint after the second, then (``resume``) the last 3 again from that checkpoint."""
    features = encoded_conversations(model_id)
    data_ranks = mesh.data_world_size if mesh is not None else 1
    rank = mesh.data_rank(int(os.environ["RANK"])) if mesh is not None else 0
    batch = features[rank::data_ranks]  # each data-parallel rank's share; tensor-parallel ranks share theirs
    return train_save_resume(lambda: make_model(mesh, lora, model_id, targets), batch, output_dir, 3, resume)


def train_tenants(mesh: DeviceMesh | None, recompute: bool = False) -> dict[str, dict[str, list[float]]]:
    """:data:`TENANTS` for 3 steps in shared ``forward_backward_many`` passes, each on its own half of the data:
    each one's losses and gradient norms (``recompute``: with activation checkpointing)."""
    model = MultiLoraMegatronModel(
        MOE_MODEL, device="cpu", dtype=torch.float64, device_mesh=mesh, max_rank=4, gradient_checkpointing=recompute
    )
    features = encoded_conversations(MOE_MODEL)
    record: dict[str, dict[str, list[float]]] = {}
    for seed, (name, (rank, targets)) in enumerate(TENANTS.items()):
        modules = targets if isinstance(targets, str) else list(targets)
        model.add_adapter_to_model(name, LoraConfig(r=rank, lora_alpha=8, target_modules=modules), seed=seed)
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
        record[name] = {"losses": [], "norms": []}
    data_ranks = mesh.data_world_size if mesh is not None else 1
    rank = mesh.data_rank(int(os.environ["RANK"])) if mesh is not None else 0
    for _step in range(3):  # each data-parallel rank passes its share of each tenant's data
        requests = [AdapterRequest(name, features[index::2][rank::data_ranks]) for index, name in enumerate(TENANTS)]
        for name, result in zip(TENANTS, model.forward_backward_many(requests), strict=True):
            record[name]["losses"].append(result.unwrap().loss)
            record[name]["norms"].append(model.clip_grad_and_step(adapter_name=name)["grad_norm"])
    return record


def train_router_loss(mesh: DeviceMesh | None, recompute: bool = False) -> dict[str, Any]:
    """Every weight of the MoE builtin with the router's load-balancing loss, 3 steps: losses, gradient norms and
    the mean aux loss (a large coefficient, so a miscounted aux gradient shows at once); ``recompute``: with
    activation checkpointing."""
    model = MegatronModel(
        MOE_MODEL, device="cpu", dtype=torch.float64, device_mesh=mesh, gradient_checkpointing=recompute, **ROUTER_LOSS
    )
    model.set_optimizer("AdamW", lr=1e-3)
    losses, norms = steps(model, encoded_conversations(MOE_MODEL), 3)  # tensor-parallel ranks share the batch
    return {"losses": losses, "norms": norms, "aux": model.calculate_metric()["loss/router_aux_loss"]}


def train_schedule(mesh: DeviceMesh | None, schedule: str) -> dict[str, Any]:
    """Tenant ``bad`` (its loss raises in its first micro-batch) and tenant ``x`` in one
    ``forward_backward_many`` call, one row per micro-batch (passes ``bad``, ``bad``, ``x``, ``x``), 2 steps:
    ``x``'s losses and norms, ``bad``'s errors, and in which order this rank's first decoder layer ran its
    forwards (``F``) and backwards (``B``) in the first call."""
    model = MultiLoraMegatronModel(
        MODEL, device="cpu", dtype=torch.float64, device_mesh=mesh, max_rank=4, pipeline_schedule=schedule
    )
    for seed, name in enumerate(("bad", "x")):
        model.add_adapter_to_model(name, LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR), seed=seed)
    model.set_optimizer("AdamW", adapter_name="x", lr=1e-2)
    model.set_loss(RaisingLoss(), adapter_name="bad")
    features = encoded_conversations(MODEL)
    bad = [{**features[0], "input_ids": [TRIGGER, *features[0]["input_ids"][1:]]}, features[1]]
    order: list[str] = []
    layer = model.model.gpt.decoder.layers[0]
    hook = layer.register_forward_hook(lambda _module, _args, output: _record(order, output[0]))
    record: dict[str, Any] = {"losses": [], "norms": [], "errors": []}
    for _step in range(2):
        results = model.forward_backward_many(
            [AdapterRequest("bad", bad), AdapterRequest("x", features[2:])], micro_batch_size=1
        )
        hook.remove()  # the first call's order only
        record["errors"].append(str(results[0].error))
        record["losses"].append(results[1].unwrap().loss)
        record["norms"].append(model.clip_grad_and_step(adapter_name="x")["grad_norm"])
    return {**record, "order": "".join(order)}


def vocab_parallel_errors() -> dict[str, Any]:
    """Float64 logits of 6 tokens over a vocabulary of 10, this rank holding its half: how far
    ``vocab_parallel_logps``'s log-probs of two targets per token (both halves' edge tokens among them) and their
    gradient are from ``log_softmax`` of the whole, and whether its argmax hits are the whole's (a tie across
    the halves included: the lower index wins, as ``argmax``)."""
    if not dist.is_initialized():  # no model has joined the processes yet
        dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    logits_NV = torch.randn(6, 10, generator=generator, dtype=torch.float64)
    logits_NV[1, 2] = logits_NV[1, 7] = logits_NV[1].max() + 1  # a tie between the halves
    logits_NV[4, 9] = logits_NV[4].max() + 1  # a hit on the last token
    targets_NK = torch.tensor([[0, 9], [2, 7], [4, 5], [5, 4], [9, 0], [7, 3]])
    weights_NK = torch.randn(6, 2, generator=generator, dtype=torch.float64)
    local_NV = logits_NV.chunk(size, dim=-1)[rank].clone().requires_grad_()
    logps_NK, correct_N = vocab_parallel_logps(local_NV, targets_NK, rank * local_NV.shape[-1], None, size)
    (logps_NK * weights_NK).sum().backward()
    whole_NV = logits_NV.clone().requires_grad_()
    expected_NK = whole_NV.log_softmax(dim=-1).gather(-1, targets_NK)
    (expected_NK * weights_NK).sum().backward()
    assert local_NV.grad is not None and whole_NV.grad is not None
    return {
        "logps": float((logps_NK - expected_NK).abs().max()),
        "grad": float((local_NV.grad - whole_NV.grad.chunk(size, dim=-1)[rank]).abs().max()),
        "correct": correct_N.tolist(),
        "expected_correct": (whole_NV.argmax(dim=-1) == targets_NK[:, 0]).tolist(),
    }


def _record(order: list[str], output_SBH: torch.Tensor) -> None:
    order.append("F")
    if output_SBH.requires_grad:
        output_SBH.register_hook(lambda grad: order.append("B"))


def main(layouts: list[str], output_dir: Path) -> None:
    """Each layout in turn, in these processes (megatron-core's groups are rebuilt between layouts)."""
    from megatron.core import parallel_state

    twinkle.initialize(seed=0)
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for layout in layouts:
        if layout in ROUTER_LAYOUTS:
            sizes = {f"{dim}_size": world for dim in ROUTER_LAYOUTS[layout]}
            results[layout] = train_router_loss(DeviceMesh.from_sizes(world_size=world, **sizes), recompute=True)
            parallel_state.destroy_model_parallel()
            continue
        if layout == "vocab-parallel":
            results[layout] = vocab_parallel_errors()
            continue
        if layout in SCHEDULE_LAYOUTS:
            mesh = DeviceMesh.from_sizes(world_size=world, pp_size=world)
            results[layout] = train_schedule(mesh, SCHEDULE_LAYOUTS[layout])
            parallel_state.destroy_model_parallel()
            continue
        if layout in TENANT_LAYOUTS:
            sizes = {f"{dim}_size": world for dim in TENANT_LAYOUTS[layout]}
            results[layout] = train_tenants(DeviceMesh.from_sizes(world_size=world, **sizes), recompute=True)
            parallel_state.destroy_model_parallel()
            continue
        model_id, sizes, targets = LAYOUTS[layout]
        mesh = DeviceMesh.from_sizes(world_size=world, **{f"{dim}_size": size for dim, size in sizes.items()})
        results[layout] = {
            kind: run(mesh, kind == "lora", output_dir / layout / kind, model_id, targets, layout in RESUMED)
            for kind in KINDS
        }
        parallel_state.destroy_model_parallel()
    if twinkle.is_master():
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(","), Path(sys.argv[2]))
