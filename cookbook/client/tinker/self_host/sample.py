"""Sampling with the unmodified ``tinker`` SDK against a Twinkle server: the base model or trained weights.

The prompts are encoded here with Twinkle's chat template for the server's base model, sent as
Tinker ``ModelInput``s, and the sampled tokens decoded with the same template. Start a server and
create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal (MODEL_PATH: the sampler weights self_cognition.py printed; a
``twinkle://<run>/sampler_weights/<name>`` path works too):

    TWINKLE_API_KEY=<the key> python cookbook/client/tinker/self_host/sample.py
    TWINKLE_API_KEY=<the key> MODEL_PATH=tinker://<run>/sampler_weights/self-cognition \\
        python cookbook/client/tinker/self_host/sample.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. NUM_SAMPLES, MAX_NEW_TOKENS, TEMPERATURE and
SEED set the sampling; MODEL_ID must name the server's base model.
"""

import os

from twinkle import init_tinker_client
from twinkle.template import Template

init_tinker_client()  # TINKER_BASE_URL / TINKER_API_KEY from TWINKLE_BASE_URL / TWINKLE_API_KEY

from tinker import ServiceClient, types  # noqa: E402 (after init_tinker_client)

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
MODEL_PATH = os.environ.get("MODEL_PATH", "")  # empty: the base model
NUM_SAMPLES = int(os.environ.get("NUM_SAMPLES", 2))
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", 40))
TEMPERATURE = float(os.environ.get("TEMPERATURE", 0.7))
SEED = int(os.environ.get("SEED", 0))
QUESTIONS = ["Who are you?", "你是谁？"]


def main() -> None:
    service_client = ServiceClient()
    if MODEL_PATH:
        sampling_client = service_client.create_sampling_client(model_path=MODEL_PATH).result()
    else:
        sampling_client = service_client.create_sampling_client(base_model=MODEL_ID).result()
    template = Template(MODEL_ID, enable_thinking=False)
    params = types.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, seed=SEED)
    futures = []
    for question in QUESTIONS:  # every request is sent before the first answer is awaited
        prompt = template.encode({"messages": [{"role": "user", "content": question}]}, add_generation_prompt=True)
        model_input = types.ModelInput.from_ints(list(prompt["input_ids"]))
        futures.append(sampling_client.sample(prompt=model_input, num_samples=NUM_SAMPLES, sampling_params=params))
    count = 0
    for question, future in zip(QUESTIONS, futures, strict=True):
        for index, sequence in enumerate(future.result().sequences):
            print(f"Q: {question}\nA[{index}]: {template.decode(sequence.tokens, skip_special_tokens=True).strip()}")
            count += 1
    source = MODEL_PATH or f"the base model {MODEL_ID}"
    print(f"sampled {count} completions ({len(QUESTIONS)} questions x {NUM_SAMPLES}) from {source}")
    service_client.close("success").result()


if __name__ == "__main__":
    main()
