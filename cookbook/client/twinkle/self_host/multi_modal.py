"""Image-question LoRA SFT on a Twinkle server hosting the vision-language builtin://qwen3-vl-tiny.

The server holds builtin://clevr-mini and turns its rows into conversations (``CLEVRProcessor``); each
batch comes back here as trajectories whose ``images`` are the scenes' PNG bytes (``data:`` URIs), and
``forward_backward`` sends them back by value: the server's template turns each image into the model's
vision tokens and pixel values. Local paths, bytes and PIL images in a trajectory are sent the same way
(read here, never from the server's disk), within the server's image quotas (``max_images_per_request``,
``max_image_bytes``). Start a server for the model and create a user, which prints an API key:

    twinkle server --config cookbook/client/server/transformer/multi_modal.yaml
    twinkle server add-user me --config cookbook/client/server/transformer/multi_modal.yaml

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/twinkle/self_host/multi_modal.py

Knobs: MAX_STEPS, BATCH_SIZE, LR, LORA_RANK, SEED, MODEL_ID (the server's base model). It prints the
loss of every step and a greedy answer to a held-out scene.
"""

import os

from twinkle.data_format import SamplingParams
from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import TransformersModel
from twinkle_client.preprocessor import CLEVRProcessor
from twinkle_client.sampler import TorchSampler

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-vl-tiny")
MAX_STEPS = int(os.environ.get("MAX_STEPS", 30))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))
LEARNING_RATE = float(os.environ.get("LR", 2e-3))
LORA_RANK = int(os.environ.get("LORA_RANK", 16))
SEED = int(os.environ.get("SEED", 42))
# The language model's layers; target_modules="all-linear" adapts the vision tower and its mergers too.
LANGUAGE = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def scenes(split: str, include_answer: bool) -> Dataset:
    dataset = Dataset(DatasetMeta("builtin://clevr-mini", split=split))
    dataset.map(CLEVRProcessor(include_answer=include_answer))  # trajectories: "<image>question" + the scene
    return dataset


def main() -> None:
    init_twinkle_client()  # TWINKLE_BASE_URL, TWINKLE_API_KEY
    dataloader = DataLoader(dataset=scenes("train", True), batch_size=BATCH_SIZE, shuffle=True, seed=SEED)
    model = TransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("clevr", LoraConfig(r=LORA_RANK, lora_alpha=32, target_modules=LANGUAGE), seed=SEED)
    model.set_template("Template", model_id=MODEL_ID, enable_thinking=False)
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    losses: list[float] = []
    while len(losses) < MAX_STEPS:
        for batch in dataloader:
            output = model.forward_backward(inputs=batch)  # the images travel by value
            model.clip_grad_and_step()
            losses.append(float(output.loss))
            print(f"step {len(losses)}: loss {losses[-1]:.3f}")
            if len(losses) == MAX_STEPS:
                break
    sampler = TorchSampler(model_id=MODEL_ID)
    sampler.set_template("Template", model_id=MODEL_ID, enable_thinking=False)
    question = next(iter(DataLoader(dataset=scenes("test", False), batch_size=1)))[0]
    answer = sampler.sample(question, SamplingParams(max_tokens=4, temperature=0.0), adapter_name="clevr")
    print(f"Q: {question['messages'][-1]['content']!r} A: {answer.sequences[0].decoded!r}")
    print(f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
