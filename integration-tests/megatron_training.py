"""Under ``torchrun --nproc_per_node 2``: MegatronModel trains with ``tp_size=2``, ``pp_size=2`` or ``dp_size=2``.

    torchrun --nproc_per_node 2 integration-tests/megatron_training.py tp OUTPUT_DIR

Every weight, then a LoRA adapter on every projection (PEFT's "all-linear"), trains for 5 steps in
float64 (a checkpoint with the optimizer after step 2, the final weights after step 5); a fresh model
then resumes from the step-2 checkpoint for the last 3 steps. Rank 0 prints ``RESULT`` and the JSON of
each kind's losses, gradient norms and paths; the same runs in one process are :func:`run` with no mesh.
test_megatron_parallel.py runs both and compares.
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
from twinkle.model.megatron import MegatronModel

MODEL = "builtin://qwen3-tiny"


def make_model(mesh: DeviceMesh | None, lora: bool) -> MegatronModel:
    model = MegatronModel(MODEL, device="cpu", dtype=torch.float64, device_mesh=mesh)
    if lora:
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), seed=0)
    model.set_optimizer("AdamW", lr=1e-2 if lora else 1e-3)
    return model


def run(mesh: DeviceMesh | None, lora: bool, output_dir: Path) -> dict[str, Any]:
    """4 steps with a checkpoint after the second, then the last 2 again from that checkpoint."""
    features = encoded_conversations(MODEL)
    data_ranks = mesh.data_world_size if mesh is not None else 1
    rank = mesh.data_rank(int(os.environ["RANK"])) if mesh is not None else 0
    batch = features[rank::data_ranks]  # each data-parallel rank's share; tensor-parallel ranks share theirs
    return train_save_resume(lambda: make_model(mesh, lora), batch, output_dir, after=3)


def main(layout: str, output_dir: Path) -> None:
    twinkle.initialize(seed=0)
    world = int(os.environ["WORLD_SIZE"])
    mesh = DeviceMesh.from_sizes(world_size=world, **{f"{layout}_size": world})
    result = {kind: run(mesh, kind == "lora", output_dir / kind) for kind in ("full", "lora")}
    if twinkle.is_master():
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
