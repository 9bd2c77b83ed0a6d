"""Under ``torchrun --nproc_per_node 2``: training the experts under expert parallelism equals one process.

    torchrun --nproc_per_node 2 integration-tests/expert_parallel_training.py OUTPUT_DIR

For the experts' LoRA pairs (PEFT's "all-linear" on the MoE builtin: attention, router and every expert)
and for full-parameter training, each rank trains 4 steps with its half of the experts (``ep_size=2``
over FSDP2), saving a checkpoint with its optimizer after step 2, then resumes a fresh model from that
checkpoint for the last 2 steps; the same runs go in this process alone. Rank 0 prints ``RESULT`` and
the JSON of every run's losses, gradient norms and the checkpoints' paths. test_expert_parallel.py runs
it and compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from conversations import encoded_conversations  # beside this script
from peft import LoraConfig
from resumed_training import train_save_resume

import twinkle
from twinkle import DeviceMesh
from twinkle.model import TransformersModel

MOE = "builtin://qwen3-moe-tiny"
OPTIONS: dict[str, Any] = {"dtype": torch.float64, "experts_implementation": "eager"}  # grouped matmul: no fp64


def features() -> list[dict[str, Any]]:
    return encoded_conversations(MOE)


def _model(mesh: DeviceMesh, lora: bool) -> TransformersModel:
    model = TransformersModel(MOE, device="cpu", device_mesh=mesh, **OPTIONS)
    if lora:
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), seed=0)
    model.set_optimizer("AdamW", lr=1e-2 if lora else 1e-3)
    return model


def run(mesh: DeviceMesh, lora: bool, output_dir: Path) -> dict[str, Any]:
    """4 steps with a checkpoint after the second, then the last 2 again from that checkpoint."""
    rank = int(os.environ["RANK"]) if mesh.world_size > 1 else 0
    batch = features()[rank :: mesh.world_size]  # each rank's share of the global batch, as a DataLoader deals it
    return train_save_resume(lambda: _model(mesh, lora), batch, output_dir)


def main(output_dir: Path) -> None:
    twinkle.initialize(seed=0)
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    for kind in ("lora", "full"):
        split = DeviceMesh.from_sizes(world_size=world, fsdp_size=world, ep_size=world)
        results[f"{kind}-split"] = run(split, kind == "lora", output_dir / f"{kind}-split")
        if twinkle.is_master():  # alone: rank 0 only, as one process would
            results[f"{kind}-alone"] = run(DeviceMesh.from_sizes(), kind == "lora", output_dir / f"{kind}-alone")
    if twinkle.is_master():
        print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
