"""Image-question LoRA SFT with the unmodified ``tinker`` SDK against a Twinkle server hosting builtin://qwen3-vl-tiny.

As with Tinker itself, the client tokenizes and the image travels as its encoded bytes: Twinkle's template
renders each builtin://clevr-mini conversation here (the server's base model's chat template), and
``input_feature_to_datum(feature, images=[png])`` makes a ``Datum`` whose model input is text chunks around
an image chunk (``tinker.types.ImageChunk``, ``expected_tokens`` = the image's vision tokens). The server
runs the image through the model's image processor, checks ``expected_tokens``, and trains on exactly the
feature the template made. Start a server for the model and create a user, which prints an API key:

    twinkle server --config cookbook/client/server/transformer/multi_modal.yaml
    twinkle server add-user me --config cookbook/client/server/transformer/multi_modal.yaml

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/tinker/self_host/multi_modal.py

Knobs: MAX_STEPS, BATCH_SIZE, LR, LORA_RANK, MODEL_ID (the server's base model). It prints the loss per
trained token of every step and a greedy answer to a held-out scene, sampled from an image prompt.
"""

import base64
import itertools
import os

from twinkle import init_tinker_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import CLEVRProcessor
from twinkle.template import Template
from twinkle_client import input_feature_to_datum

init_tinker_client()  # TINKER_BASE_URL / TINKER_API_KEY from TWINKLE_BASE_URL / TWINKLE_API_KEY

from tinker import ServiceClient, types  # noqa: E402 (after init_tinker_client)

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-vl-tiny")
MAX_STEPS = int(os.environ.get("MAX_STEPS", 30))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 8))
LEARNING_RATE = float(os.environ.get("LR", 2e-3))
LORA_RANK = int(os.environ.get("LORA_RANK", 16))


def scenes(split: str, include_answer: bool) -> Dataset:
    """Rows as trajectories ("<image>question", the answer), images kept as the scenes' PNG data URIs."""
    dataset = Dataset(DatasetMeta("builtin://clevr-mini", split=split))
    dataset.map(CLEVRProcessor(include_answer=include_answer))
    return dataset


def png_bytes(trajectory: dict) -> list[bytes]:
    return [base64.b64decode(image.partition(",")[2]) for image in trajectory["images"]]


def main() -> None:
    template = Template(model_id=MODEL_ID, max_length=256, enable_thinking=False)
    dataloader = DataLoader(dataset=scenes("train", True), batch_size=BATCH_SIZE, shuffle=True)
    service_client = ServiceClient()
    training_client = service_client.create_lora_training_client(base_model=MODEL_ID, rank=LORA_RANK).result()
    losses = []
    for step, batch in enumerate(
        itertools.islice(itertools.chain.from_iterable(itertools.repeat(dataloader)), MAX_STEPS)
    ):
        data = [input_feature_to_datum(template.encode(row), images=png_bytes(row)) for row in batch]
        fwdbwd = training_client.forward_backward(data, "cross_entropy")
        optim = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        output = fwdbwd.result()
        optim.result()
        trained = sum(float(datum.loss_fn_inputs["weights"].to_numpy().sum()) for datum in data)
        losses.append(output.metrics["loss:sum"] / trained)
        print(f"step {step + 1}: loss per token {losses[-1]:.3f}")
    sampler = training_client.save_weights_and_get_sampling_client()
    question = next(iter(DataLoader(dataset=scenes("test", False), batch_size=1)))[0]
    prompt = template.encode(question, add_generation_prompt=True)
    ids, image_tokens = prompt["input_ids"], prompt["mm_token_type_ids"]
    first, count = image_tokens.index(1), sum(image_tokens)  # the scene's run of vision tokens
    (image,) = png_bytes(question)
    model_input = types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=ids[:first]),
            types.ImageChunk(data=image, format="png", expected_tokens=count),
            types.EncodedTextChunk(tokens=ids[first + count :]),
        ]
    )
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    tokens = sampler.sample(model_input, 1, params).result().sequences[0].tokens
    print(f"Q: {question['messages'][-1]['content']!r} A: {template.decode(tokens, skip_special_tokens=True)!r}")
    print(f"loss: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
