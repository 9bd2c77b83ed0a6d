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

import os

from self_cognition import WORLD_SIZE, train_on_mesh

from twinkle import DeviceMesh

ULYSSES_SIZE = int(os.environ.get("ULYSSES_SIZE", WORLD_SIZE))  # must divide the world and the attention heads
GRADIENT_CHECKPOINTING = os.environ.get("GRADIENT_CHECKPOINTING", "0") == "1"
PADDING_FREE = os.environ.get("PADDING_FREE", "1") == "1"
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-sequence-parallel")


def main() -> None:
    # Each Ulysses group gets its share of every batch, and splits its rows' tokens.
    mesh = DeviceMesh.from_sizes(world_size=WORLD_SIZE, fsdp_size=WORLD_SIZE, ulysses_size=ULYSSES_SIZE)
    train_on_mesh(
        mesh,
        "LoRA SFT, Ulysses sequence parallel",
        output_dir=OUTPUT_DIR,
        padding_free=PADDING_FREE,
        gradient_checkpointing=GRADIENT_CHECKPOINTING,
    )


if __name__ == "__main__":
    main()
