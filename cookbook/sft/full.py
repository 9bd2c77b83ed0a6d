"""Full-parameter SFT of the embedded default model on the self-cognition set.

The same loop as ``self_cognition.py`` (reused from it, with its BATCH_SIZE, MAX_STEPS and
MAX_NEW_TOKENS knobs), with no adapter: the optimizer updates every weight, and the checkpoint
is a complete transformers model directory. EPOCHS passes over the data, one step per batch;
every step's loss is written to loss.json, the curve to loss.png.

    python cookbook/sft/full.py
"""

import json
import os

from self_cognition import (
    MAX_STEPS,
    MODEL_ID,
    QUESTIONS,
    ask,
    create_dataloader,
    local_components,
    save_loss_curve,
    train,
)

import twinkle

EPOCHS = int(os.environ.get("EPOCHS", 5))
LEARNING_RATE = float(os.environ.get("LR", 3e-3))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-full")


def main() -> None:
    twinkle.initialize(seed=42)
    components = local_components()
    dataloader = create_dataloader(components)
    model = components.TransformersModel(model_id=MODEL_ID)  # no adapter: all parameters train
    model.set_optimizer("AdamW", lr=LEARNING_RATE, weight_decay=0.01)
    steps = EPOCHS * len(dataloader)  # the schedule's length; MAX_STEPS stops early on it
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=min(5, steps), num_training_steps=steps)
    losses = train(model, dataloader, EPOCHS, MAX_STEPS)
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    save_loss_curve(losses, os.path.join(OUTPUT_DIR, "loss.png"), title="Full-parameter SFT on self-cognition")
    with open(os.path.join(OUTPUT_DIR, "loss.json"), "w") as handle:
        json.dump(losses, handle)
    checkpoint = model.save("last-checkpoint", output_dir=OUTPUT_DIR, save_optimizer=False)
    print(
        f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f} ({len(losses)} steps, "
        f"{EPOCHS} epochs of {len(dataloader)} batches); model saved to {checkpoint}"
    )
    for question, answer in zip(QUESTIONS, ask(components, model, QUESTIONS), strict=True):
        print(f"Q: {question}\nA: {answer}")


if __name__ == "__main__":
    main()
