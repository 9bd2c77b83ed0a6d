"""LoRA SFT of the embedded Qwen3-MoE (8 experts, top-2) on the self-cognition set, in one process or over FSDP2.

    python cookbook/sft/moe.py
    torchrun --nproc_per_node 2 cookbook/sft/moe.py     # FSDP2: every process holds 1/2 of every weight

The adapter is PEFT's "all-linear" on a MoE model: attention, the router and, per expert, the fused
expert tensors. Set MODEL_ID to train a real one (e.g. hf://Qwen/Qwen3-30B-A3B). The loop, knobs and
outputs are self_cognition.py's (EPOCHS, BATCH_SIZE, MAX_STEPS, MAX_NEW_TOKENS; loss.json, loss.png and
the adapter in OUTPUT_DIR, written by rank 0); expert_parallel.py runs the same with the experts spread
over the processes.
"""

from __future__ import annotations

import os

from self_cognition import WORLD_SIZE, train_on_mesh

from twinkle import DeviceMesh

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-moe-tiny")
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-moe")


def main() -> None:
    mesh = DeviceMesh.from_sizes(world_size=WORLD_SIZE, fsdp_size=WORLD_SIZE)
    train_on_mesh(mesh, "MoE LoRA SFT (FSDP2)", model_id=MODEL_ID, output_dir=OUTPUT_DIR)


if __name__ == "__main__":
    main()
