"""Sampling on a Twinkle server: completions of a few questions, from the base model or a trained adapter.

The server's sampler encodes the chat messages with the template named here and decodes the
completions; nothing here needs torch or a tokenizer. Start a server and create a user, which prints
an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal (ADAPTER_PATH: the ``twinkle://`` path self_cognition.py printed):

    TWINKLE_API_KEY=<the key> python cookbook/client/twinkle/self_host/sample.py
    TWINKLE_API_KEY=<the key> ADAPTER_PATH=twinkle://<run>/last-checkpoint \\
        python cookbook/client/twinkle/self_host/sample.py

The adapter is loaded into a LoRA run of the same shape as self_cognition.py's (LORA_RANK, default
16, alpha twice the rank, all linear layers); the sampler then uses that run's weights.
TWINKLE_BASE_URL defaults to http://127.0.0.1:8000; NUM_SAMPLES, MAX_NEW_TOKENS, TEMPERATURE and
SEED set the sampling, MODEL_ID must name the server's base model.
"""

import os

from twinkle.data_format import SamplingParams
from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.checkpoint_engine import CheckpointEngineManager
from twinkle_client.model import TransformersModel
from twinkle_client.sampler import TorchSampler

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
ADAPTER_PATH = os.environ.get("ADAPTER_PATH", "")  # empty: the base model
LORA_RANK = int(os.environ.get("LORA_RANK", 16))
NUM_SAMPLES = int(os.environ.get("NUM_SAMPLES", 2))
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", 40))
TEMPERATURE = float(os.environ.get("TEMPERATURE", 0.7))
SEED = int(os.environ.get("SEED", 0))
QUESTIONS = ["Who are you?", "你是谁？"]
ADAPTER_NAME = "default"


def main() -> None:
    init_twinkle_client()  # TWINKLE_BASE_URL, TWINKLE_API_KEY
    sampler = TorchSampler(model_id=MODEL_ID)
    sampler.set_template("Template", model_id=MODEL_ID, enable_thinking=False)
    adapter_name = None  # the base model
    if ADAPTER_PATH:
        model = TransformersModel(model_id=MODEL_ID)
        lora = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear")
        model.add_adapter_to_model(ADAPTER_NAME, lora)
        model.load(ADAPTER_PATH)
        CheckpointEngineManager(model, sampler).sync_weights()
        adapter_name = ADAPTER_NAME
    prompts = [{"messages": [{"role": "user", "content": question}]} for question in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=SEED)
    response = sampler.sample(prompts, params, adapter_name=adapter_name, num_samples=NUM_SAMPLES)
    for index, sequence in enumerate(response.sequences):  # prompt-major: NUM_SAMPLES per question
        print(f"Q: {QUESTIONS[index // NUM_SAMPLES]}\nA[{index % NUM_SAMPLES}]: {sequence.decoded.strip()}")
    source = ADAPTER_PATH or f"the base model {MODEL_ID}"
    print(f"sampled {len(response.sequences)} completions ({len(QUESTIONS)} questions x {NUM_SAMPLES}) from {source}")


if __name__ == "__main__":
    main()
