"""MoE LoRA SFT with expert parallelism over FSDP2: each process holds 1/EP_SIZE of every layer's experts.

    EP_SIZE=2 torchrun --nproc_per_node 2 cookbook/sft/expert_parallel.py
    python cookbook/sft/expert_parallel.py       # one process: the same losses

Every token's hidden state travels to the process holding each expert its router chose (all-to-all
within the expert-parallel group) and comes back weighted; the rest of the model is sharded with FSDP2.
The adapter is moe.py's: LoRA on every linear layer, the router and each expert (PEFT's "all-linear"
on a MoE model), each process training its own experts' pairs; the saved adapter is whole, as one
process saves it. ULYSSES_SIZE=2 also splits every sequence's tokens
over the processes (sequence_parallel.py); GRADIENT_CHECKPOINTING=1 recomputes the layers in backward;
PADDING_FREE=0 pads the batches instead of packing them. The rest is moe.py's.
"""

from __future__ import annotations

import os

from moe import MODEL_ID, OUTPUT_DIR
from self_cognition import WORLD_SIZE, train_on_mesh

from twinkle import DeviceMesh

EP_SIZE = int(os.environ.get("EP_SIZE", WORLD_SIZE))  # must divide the processes and every layer's experts
ULYSSES_SIZE = int(os.environ.get("ULYSSES_SIZE", 1))
GRADIENT_CHECKPOINTING = os.environ.get("GRADIENT_CHECKPOINTING", "0") == "1"
PADDING_FREE = os.environ.get("PADDING_FREE", "1") == "1"


def main() -> None:
    mesh = DeviceMesh.from_sizes(
        world_size=WORLD_SIZE, fsdp_size=WORLD_SIZE, ep_size=EP_SIZE, ulysses_size=ULYSSES_SIZE
    )
    train_on_mesh(
        mesh,
        title=f"MoE LoRA SFT, experts over {EP_SIZE} process(es)",
        model_id=MODEL_ID,
        output_dir=OUTPUT_DIR,
        gradient_checkpointing=GRADIENT_CHECKPOINTING,
        padding_free=PADDING_FREE,
    )


if __name__ == "__main__":
    main()
