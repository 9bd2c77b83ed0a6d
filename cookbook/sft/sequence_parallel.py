"""LoRA SFT with Ulysses sequence parallelism over FSDP2: every batch's tokens split over the processes.

    ULYSSES_SIZE=2 torchrun --nproc_per_node 2 cookbook/sft/sequence_parallel.py
    python cookbook/sft/sequence_parallel.py      # one process: the same losses

Each batch is packed padding-free into one long row (the samples stay apart: each attends only to
itself). The processes shard the model with FSDP2 (fsdp_size = all of them), and each Ulysses group
of ULYSSES_SIZE processes shares its samples: every process runs the decoder on its 1/ULYSSES_SIZE of
the row's tokens, exchanging attention heads with its group, so a process keeps that share of the
activations: what makes long sequences fit. GRADIENT_CHECKPOINTING=1 recomputes the decoder layers
in backward as well; PADDING_FREE=0 pads the batch instead of packing it.

The loop, knobs and outputs are self_cognition.py's (EPOCHS, BATCH_SIZE, MAX_STEPS, MAX_NEW_TOKENS,
MODEL_ID; loss.json, loss.png and the adapter in OUTPUT_DIR, written by rank 0).
"""

import json
import os

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

ULYSSES_SIZE = int(os.environ.get("ULYSSES_SIZE", WORLD_SIZE))  # must divide the world and the attention heads
GRADIENT_CHECKPOINTING = os.environ.get("GRADIENT_CHECKPOINTING", "0") == "1"
PADDING_FREE = os.environ.get("PADDING_FREE", "1") == "1"
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-sequence-parallel")


def main() -> None:
    mesh = DeviceMesh.from_sizes(world_size=WORLD_SIZE, fsdp_size=WORLD_SIZE, ulysses_size=ULYSSES_SIZE)
    twinkle.initialize(seed=42, global_device_mesh=mesh)
    components = local_components()
    dataloader = create_dataloader(components)  # each Ulysses group gets its share of every batch
    model = create_model(
        components, num_training_steps=EPOCHS * len(dataloader), gradient_checkpointing=GRADIENT_CHECKPOINTING
    )
    model.set_processor("InputProcessor", padding_free=PADDING_FREE)
    losses = train(model, dataloader, EPOCHS, MAX_STEPS)
    checkpoint = model.save("last-checkpoint", output_dir=OUTPUT_DIR)
    answers = ask(components, model, QUESTIONS)
    if not twinkle.is_master():
        return
    save_loss_curve(losses, os.path.join(OUTPUT_DIR, "loss.png"), title="LoRA SFT, Ulysses sequence parallel")
    with open(os.path.join(OUTPUT_DIR, "loss.json"), "w") as handle:
        json.dump(losses, handle)
    print(
        f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f} ({len(losses)} steps, "
        f"{WORLD_SIZE} process(es), ulysses_size={ULYSSES_SIZE}); adapter saved to {checkpoint}"
    )
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer}")


if __name__ == "__main__":
    main()
