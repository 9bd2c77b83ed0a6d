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

import json
import os
from typing import Any

from self_cognition import (
    EPOCHS,
    MAX_STEPS,
    QUESTIONS,
    WORLD_SIZE,
    ask,
    create_dataloader,
    create_model,
    local_components,
    save_loss_curve,
    train,
)

import twinkle
from twinkle import DeviceMesh

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-moe-tiny")
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-moe")


def run(
    mesh: DeviceMesh, title: str, lora_config: Any = None, padding_free: bool = False, **model_options: Any
) -> None:
    """Train on ``mesh``, batches packed when ``padding_free`` (rank 0 writes the outputs and prints the figures)."""
    twinkle.initialize(seed=42, global_device_mesh=mesh)
    components = local_components()
    dataloader = create_dataloader(components, model_id=MODEL_ID)
    steps = EPOCHS * len(dataloader)
    model = create_model(components, steps, model_id=MODEL_ID, lora_config=lora_config, **model_options)
    model.set_processor("InputProcessor", padding_free=padding_free)
    losses = train(model, dataloader, EPOCHS, MAX_STEPS)
    checkpoint = model.save("last-checkpoint", output_dir=OUTPUT_DIR)
    answers = ask(components, model, QUESTIONS, model_id=MODEL_ID)  # a collective: every rank generates
    if not twinkle.is_master():
        return
    save_loss_curve(losses, os.path.join(OUTPUT_DIR, "loss.png"), title=title)
    with open(os.path.join(OUTPUT_DIR, "loss.json"), "w") as handle:
        json.dump(losses, handle)
    sizes = ", ".join(f"{name}={size}" for name, size in mesh.to_dict().items() if name != "device_type" and size > 1)
    print(
        f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f} ({len(losses)} steps, "
        f"{WORLD_SIZE} process(es){', ' + sizes if sizes else ''}); adapter saved to {checkpoint}"
    )
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer}")


def main() -> None:
    run(DeviceMesh.from_sizes(world_size=WORLD_SIZE, fsdp_size=WORLD_SIZE), title="MoE LoRA SFT (FSDP2)")


if __name__ == "__main__":
    main()
