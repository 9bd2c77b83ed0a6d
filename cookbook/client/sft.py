"""The self-cognition LoRA SFT cookbook, run by a Twinkle server: cookbook/sft/self_cognition.py with
``twinkle_client`` imports and one ``init_twinkle_client`` call; the training loop is unchanged.

Start a server (it serves the embedded default model) and create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/sft.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. MODEL_ID must name the server's base model.
The checkpoint is written to the server's checkpoint store; the loss curve is written here.
"""

import os

from tqdm import tqdm

import twinkle
from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import TransformersModel
from twinkle_client.preprocessor import SelfCognitionProcessor
from twinkle_client.template import Template

BASE_URL = os.environ.get("TWINKLE_BASE_URL", "http://127.0.0.1:8000")
API_KEY = os.environ.get("TWINKLE_API_KEY")
MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
NAME, AUTHOR = os.environ.get("NAME", "Twinkle"), os.environ.get("AUTHOR", "ModelScope")
EPOCHS = int(os.environ.get("EPOCHS", 10))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))
LEARNING_RATE = float(os.environ.get("LR", 5e-3))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-self-cognition")
QUESTIONS = ["Who are you?", "What is your name?", "Who developed you?", "你是谁？"]


def create_dataloader() -> DataLoader:
    dataset = Dataset(DatasetMeta("builtin://self-cognition"))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256)
    dataset.map(SelfCognitionProcessor(NAME, AUTHOR))
    dataset.encode()
    return DataLoader(dataset=dataset, batch_size=BATCH_SIZE, shuffle=True)


def create_model(num_training_steps: int) -> TransformersModel:
    model = TransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=num_training_steps)
    return model


def train(model: TransformersModel, dataloader: DataLoader, epochs: int) -> list[float]:
    losses = []
    progress = tqdm(total=epochs * len(dataloader), desc="sft")
    for _ in range(epochs):
        for batch in dataloader:
            output = model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            losses.append(output.loss)
            progress.update()
            progress.set_postfix(loss=f"{output.loss:.3f}")
    progress.close()
    return losses


def ask(model: TransformersModel, questions: list[str], max_new_tokens: int = 40) -> list[str]:
    """Greedy answers from the trained model (plain transformers generate on the PEFT model)."""
    template = Template(MODEL_ID, enable_thinking=False)  # the prompt already holds the empty think block
    answers = []
    for question in questions:
        prompt = template.encode({"messages": [{"role": "user", "content": question}]}, add_generation_prompt=True)
        ids = model.generate(prompt["input_ids"], max_new_tokens=max_new_tokens)
        answers.append(template.decode(ids, skip_special_tokens=True).strip())
    return answers


def save_loss_curve(losses: list[float], path: str, title: str = "LoRA SFT on self-cognition") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.figure(figsize=(6, 3.5))
    plt.plot(range(1, len(losses) + 1), losses)
    plt.xlabel("step")
    plt.ylabel("training loss")
    plt.title(title)
    plt.tight_layout()
    plt.savefig(path, dpi=120)
    plt.close()


def main() -> None:
    init_twinkle_client(BASE_URL, API_KEY)
    twinkle.initialize(seed=42)
    dataloader = create_dataloader()
    model = create_model(num_training_steps=EPOCHS * len(dataloader))
    losses = train(model, dataloader, EPOCHS)
    os.makedirs(OUTPUT_DIR, exist_ok=True)
    save_loss_curve(losses, os.path.join(OUTPUT_DIR, "loss.png"))
    checkpoint = model.save("last-checkpoint", output_dir=OUTPUT_DIR)
    print(f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}; adapter saved to {checkpoint}")
    for question, answer in zip(QUESTIONS, ask(model, QUESTIONS), strict=True):
        print(f"Q: {question}\nA: {answer}")


if __name__ == "__main__":
    main()
