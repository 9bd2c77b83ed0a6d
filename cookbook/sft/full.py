"""Full-parameter SFT of the embedded default model on the self-cognition set.

The same loop as ``self_cognition.py`` (reused from it), with no adapter: the
optimizer updates every weight, and the checkpoint is a complete transformers
model directory.

    python cookbook/sft/full.py
"""

import os

from self_cognition import MODEL_ID, QUESTIONS, ask, create_dataloader, save_loss_curve, train

import twinkle
from twinkle.model import TransformersModel

EPOCHS = int(os.environ.get("EPOCHS", 5))
LEARNING_RATE = float(os.environ.get("LR", 3e-3))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-full")


def main() -> None:
    twinkle.initialize(seed=42)
    dataloader = create_dataloader()
    model = TransformersModel(model_id=MODEL_ID)  # no adapter: all parameters train
    model.set_optimizer("AdamW", lr=LEARNING_RATE, weight_decay=0.01)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=EPOCHS * len(dataloader))
    losses = train(model, dataloader, EPOCHS)
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    save_loss_curve(losses, os.path.join(OUTPUT_DIR, "loss.png"), title="Full-parameter SFT on self-cognition")
    checkpoint = model.save("last-checkpoint", output_dir=OUTPUT_DIR, save_optimizer=False)
    print(f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}; model saved to {checkpoint}")
    for question, answer in zip(QUESTIONS, ask(model, QUESTIONS), strict=True):
        print(f"Q: {question}\nA: {answer}")


if __name__ == "__main__":
    main()
