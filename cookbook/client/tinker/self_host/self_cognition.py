"""Self-cognition LoRA SFT with the unmodified ``tinker`` SDK against a Twinkle server (seed 000's Tinker listing).

The data are prepared here with Twinkle's own dataset pipeline (the server's base model's chat
template, the self-cognition preprocessor) and turned into Tinker ``Datum``s by
``input_feature_to_datum``; ``init_tinker_client`` points the SDK at the Twinkle server. Training
is Tinker's ``forward_backward(..., "cross_entropy")`` + ``optim_step``. Start a server and create a
user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/tinker/self_host/self_cognition.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000 (TINKER_BASE_URL / TINKER_API_KEY work too).
Knobs: EPOCHS, BATCH_SIZE, MAX_STEPS (0: every step of EPOCHS epochs), LR, LORA_RANK, NAME, AUTHOR,
MODEL_ID (the server's base model). The training state and the sampler weights are saved on the
server; the printed ``tinker://.../sampler_weights/...`` path is what sample.py's MODEL_PATH takes.
"""

import itertools
import os

from tqdm import tqdm

from twinkle import init_tinker_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle_client import input_feature_to_datum

init_tinker_client()  # TINKER_BASE_URL / TINKER_API_KEY from TWINKLE_BASE_URL / TWINKLE_API_KEY

from tinker import ServiceClient, types  # noqa: E402 (after init_tinker_client)

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
NAME, AUTHOR = os.environ.get("NAME", "Twinkle"), os.environ.get("AUTHOR", "ModelScope")
EPOCHS = int(os.environ.get("EPOCHS", 10))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))
MAX_STEPS = int(os.environ.get("MAX_STEPS", 0))
LEARNING_RATE = float(os.environ.get("LR", 5e-3))
LORA_RANK = int(os.environ.get("LORA_RANK", 16))


def create_dataloader() -> DataLoader:
    dataset = Dataset(DatasetMeta("builtin://self-cognition"))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256)
    dataset.map(SelfCognitionProcessor(NAME, AUTHOR))
    dataset.encode()
    return DataLoader(dataset=dataset, batch_size=BATCH_SIZE, shuffle=True)


def train() -> None:
    dataloader = create_dataloader()
    service_client = ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=MODEL_ID, rank=LORA_RANK).result()
    steps = EPOCHS * len(dataloader) if MAX_STEPS <= 0 else min(MAX_STEPS, EPOCHS * len(dataloader))
    batches = itertools.islice((batch for _ in range(EPOCHS) for batch in dataloader), steps)
    losses = []
    progress = tqdm(batches, total=steps, desc="sft")
    for batch in progress:
        data = [input_feature_to_datum(feature) for feature in batch]
        # Both requests are sent before waiting: the optimizer step queues behind the gradients.
        fwdbwd_future = training_client.forward_backward(data, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE, grad_clip_norm=1.0))
        fwdbwd, _ = fwdbwd_future.result(), optim_future.result()
        tokens = sum(float(datum.loss_fn_inputs["weights"].to_numpy().sum()) for datum in data)
        losses.append(fwdbwd.metrics["loss:sum"] / tokens)  # Tinker sums over tokens; this is the mean
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    state = training_client.save_state("self-cognition").result().path
    sampler_path = training_client.save_weights_for_sampler("self-cognition").result().path
    print(f"saved the training state to {state}")
    print(f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}; adapter saved to {sampler_path}")
    service_client.close("success").result()


if __name__ == "__main__":
    train()
