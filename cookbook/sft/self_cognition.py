"""LoRA SFT of the embedded default model on the self-cognition set, then a few answers.

The seed's SFT listing, adapted to run offline on a CPU in about a minute:

    python cookbook/sft/self_cognition.py

Set MODEL_ID (any id twinkle.hub accepts, e.g. hf://Qwen/Qwen3-0.6B) to train a real model.

The same script trains data-parallel under torchrun, on a DeviceMesh of all its processes:

    torchrun --nproc_per_node 2 cookbook/sft/self_cognition.py               # DDP (dp_size=2)
    FSDP_SIZE=2 torchrun --nproc_per_node 2 cookbook/sft/self_cognition.py   # FSDP2 (fsdp_size=2)

BATCH_SIZE is the global batch: each of N processes trains on BATCH_SIZE/N of its samples, and the
losses equal a one-process run's. Rank 0 prints and writes the outputs (loss.png, the curve's
values in loss.json, the checkpoint). MAX_STEPS stops early; MAX_NEW_TOKENS bounds the answers.

The recipe builds its parts from the classes in a ``Components``: twinkle's here, twinkle_client's in
cookbook/client/twinkle/self_host/self_cognition.py, which runs this same ``main`` on a Twinkle server.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

import twinkle
from twinkle import DeviceMesh
from twinkle.preprocessor import SelfCognitionProcessor

if TYPE_CHECKING:
    from twinkle.dataloader import DataLoader
    from twinkle.model import TransformersModel

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
NAME, AUTHOR = os.environ.get("NAME", "Twinkle"), os.environ.get("AUTHOR", "ModelScope")
EPOCHS = int(os.environ.get("EPOCHS", 10))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))
LEARNING_RATE = float(os.environ.get("LR", 5e-3))
OUTPUT_DIR = os.environ.get("OUTPUT_DIR", "outputs/sft-self-cognition")
MAX_STEPS = int(os.environ.get("MAX_STEPS", 0))  # 0: every step of EPOCHS epochs
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", 40))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # set by torchrun
FSDP_SIZE = int(os.environ.get("FSDP_SIZE", 1))  # the rest of the processes replicate (dp_size)
QUESTIONS = ["Who are you?", "What is your name?", "Who developed you?", "你是谁？"]


@dataclass(frozen=True)
class Components:
    """The classes the recipe builds: twinkle's (:func:`local_components`) or their twinkle_client twins.

    The caller imports them, so a remote run never imports the torch-backed modules.
    """

    LoraConfig: Any
    Dataset: Any
    DatasetMeta: Any
    DataLoader: Any
    TransformersModel: Any
    Template: Any


def local_components() -> Components:
    """Training in this process."""
    from peft import LoraConfig

    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.model import TransformersModel
    from twinkle.template import Template

    return Components(LoraConfig, Dataset, DatasetMeta, DataLoader, TransformersModel, Template)


def create_dataloader(components: Components, model_id: str = MODEL_ID) -> DataLoader:
    dataset = components.Dataset(components.DatasetMeta("builtin://self-cognition"))
    dataset.set_template("Template", model_id=model_id, max_length=256)
    dataset.map(SelfCognitionProcessor(NAME, AUTHOR))
    dataset.encode()
    return components.DataLoader(dataset=dataset, batch_size=BATCH_SIZE, shuffle=True)


def create_model(
    components: Components,
    num_training_steps: int,
    model_id: str = MODEL_ID,
    lora_config: Any = None,
    **model_options: Any,
) -> TransformersModel:
    """The model with a LoRA adapter (``lora_config``, by default rank 16 on every linear layer) and its optimizer."""
    model = components.TransformersModel(model_id=model_id, **model_options)
    lora_config = lora_config or components.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    model.add_adapter_to_model("default", lora_config)
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=num_training_steps)
    return model


def train(model: TransformersModel, dataloader: DataLoader, epochs: int, max_steps: int = 0) -> list[float]:
    """``epochs`` passes over ``dataloader`` (one step per batch), stopped after ``max_steps`` steps when positive."""
    steps = epochs * len(dataloader) if max_steps <= 0 else min(max_steps, epochs * len(dataloader))
    batches = itertools.islice((batch for _ in range(epochs) for batch in dataloader), steps)
    losses = []
    progress = tqdm(batches, total=steps, desc="sft", disable=not twinkle.is_master())
    for batch in progress:
        output = model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        losses.append(output.loss)
        progress.set_postfix(loss=f"{output.loss:.3f}")
    return losses


def ask(
    components: Components,
    model: TransformersModel,
    questions: list[str],
    max_new_tokens: int = MAX_NEW_TOKENS,
    model_id: str = MODEL_ID,
) -> list[str]:
    """Greedy answers from the trained model (in-process: transformers generate on the PEFT model)."""
    template = components.Template(model_id, enable_thinking=False)  # the prompt already holds the empty think block
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


def train_on_mesh(
    mesh: DeviceMesh,
    title: str,
    model_id: str = MODEL_ID,
    output_dir: str = OUTPUT_DIR,
    lora_config: Any = None,
    padding_free: bool = False,
    **model_options: Any,
) -> None:
    """This recipe in this process on ``mesh``, batches packed when ``padding_free``: the parallel cookbooks' loop.

    Rank 0 writes the outputs and prints the figures, with the mesh's sizes.
    """
    twinkle.initialize(seed=42, global_device_mesh=mesh)
    components = local_components()
    dataloader = create_dataloader(components, model_id=model_id)
    steps = EPOCHS * len(dataloader)
    model = create_model(components, steps, model_id=model_id, lora_config=lora_config, **model_options)
    model.set_processor("InputProcessor", padding_free=padding_free)
    losses = train(model, dataloader, EPOCHS, MAX_STEPS)
    checkpoint = model.save("last-checkpoint", output_dir=output_dir)
    answers = ask(components, model, QUESTIONS, model_id=model_id)  # a collective: every rank generates
    if not twinkle.is_master():
        return
    save_loss_curve(losses, os.path.join(output_dir, "loss.png"), title=title)
    with open(os.path.join(output_dir, "loss.json"), "w") as handle:
        json.dump(losses, handle)
    sizes = ", ".join(f"{name}={size}" for name, size in mesh.to_dict().items() if name != "device_type" and size > 1)
    print(
        f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f} ({len(losses)} steps, "
        f"{WORLD_SIZE} process(es){', ' + sizes if sizes else ''}); adapter saved to {checkpoint}"
    )
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer}")


def main(components: Components) -> None:
    # The components (DataLoader, TransformersModel) default to this mesh; one process: a mesh of one rank.
    twinkle.initialize(seed=42, global_device_mesh=DeviceMesh.from_sizes(world_size=WORLD_SIZE, fsdp_size=FSDP_SIZE))
    dataloader = create_dataloader(components)
    model = create_model(components, num_training_steps=EPOCHS * len(dataloader))  # MAX_STEPS stops early on it
    losses = train(model, dataloader, EPOCHS, MAX_STEPS)
    checkpoint = model.save("last-checkpoint", output_dir=OUTPUT_DIR)  # every rank takes part; rank 0 writes
    answers = ask(components, model, QUESTIONS)  # under FSDP every rank runs the generation too
    if not twinkle.is_master():
        return
    os.makedirs(OUTPUT_DIR, exist_ok=True)  # remotely the checkpoint stays on the server
    save_loss_curve(losses, os.path.join(OUTPUT_DIR, "loss.png"))
    with open(os.path.join(OUTPUT_DIR, "loss.json"), "w") as handle:
        json.dump(losses, handle)
    print(f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}; adapter saved to {checkpoint}")
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"Q: {question}\nA: {answer}")


if __name__ == "__main__":
    main(local_components())
