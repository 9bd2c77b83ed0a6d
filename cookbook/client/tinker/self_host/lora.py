"""A plain LoRA training loop with the unmodified ``tinker`` SDK against a Twinkle server.

Everything is Tinker's own API: the server's capabilities, a LoRA training client (or one resumed
from a saved state with its optimizer), datums built by hand with the tokenizer the training client
returns, ``forward_backward`` + ``optim_step`` steps, ``save_state`` after each epoch, and a sample
from the trained weights. The task is English to Pig Latin on a handful of phrases. Start a server
and create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/tinker/self_host/lora.py
    TWINKLE_API_KEY=<the key> RESUME_PATH=tinker://<run>/weights/pig-latin-epoch-1 \\
        python cookbook/client/tinker/self_host/lora.py   # continue a saved run (weights and optimizer)

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. Knobs: EPOCHS, STEPS_PER_EPOCH, LR, LORA_RANK,
MAX_NEW_TOKENS, MODEL_ID (the server's base model).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from twinkle import init_tinker_client

init_tinker_client()  # TINKER_BASE_URL / TINKER_API_KEY from TWINKLE_BASE_URL / TWINKLE_API_KEY

from tinker import ServiceClient, types  # noqa: E402 (after init_tinker_client)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
RESUME_PATH = os.environ.get("RESUME_PATH", "")
EPOCHS = int(os.environ.get("EPOCHS", 2))
STEPS_PER_EPOCH = int(os.environ.get("STEPS_PER_EPOCH", 5))
LEARNING_RATE = float(os.environ.get("LR", 5e-3))
LORA_RANK = int(os.environ.get("LORA_RANK", 16))
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", 12))
EXAMPLES = [
    ("green apple", "een-gray apple-way"),
    ("silver moon", "ilver-say oon-may"),
    ("happy dog", "appy-hay og-day"),
    ("river stone", "iver-ray one-stay"),
    ("paper kite", "aper-pay ite-kay"),
    ("winter coat", "inter-way oat-cay"),
    ("little bird", "ittle-lay ird-bay"),
]
HELD_OUT = "golden sun"


def prompt_text(english: str) -> str:
    return f"English: {english}\nPig Latin:"


def make_datum(tokenizer: PreTrainedTokenizerBase, english: str, pig_latin: str) -> types.Datum:
    """Prompt tokens weigh 0 (not trained), answer tokens 1; inputs and targets are the tokens shifted by one."""
    prompt = tokenizer.encode(prompt_text(english), add_special_tokens=True)
    answer = tokenizer.encode(f" {pig_latin}\n\n", add_special_tokens=False)
    tokens, weights = prompt + answer, [0.0] * len(prompt) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )


def main() -> None:
    service_client = ServiceClient()
    models = [model.model_name for model in service_client.get_server_capabilities().supported_models]
    print(f"the server trains: {models}")
    if RESUME_PATH:
        print(f"resuming from {RESUME_PATH}")
        training_client = service_client.create_training_client_from_state_with_optimizer(RESUME_PATH).result()
    else:
        training_client = service_client.create_lora_training_client(base_model=MODEL_ID, rank=LORA_RANK).result()
    tokenizer = training_client.get_tokenizer()
    data = [make_datum(tokenizer, english, pig_latin) for english, pig_latin in EXAMPLES]
    weights = np.concatenate([datum.loss_fn_inputs["weights"].to_numpy() for datum in data])

    losses, state_path = [], ""
    for epoch in range(EPOCHS):
        for _ in range(STEPS_PER_EPOCH):
            fwdbwd_future = training_client.forward_backward(data, "cross_entropy")
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
            fwdbwd, _ = fwdbwd_future.result(), optim_future.result()
            logprobs = np.concatenate([output["logprobs"].to_numpy() for output in fwdbwd.loss_fn_outputs])
            losses.append(float(-np.dot(logprobs, weights) / weights.sum()))  # mean loss per answer token
        state_path = training_client.save_state(f"pig-latin-epoch-{epoch + 1}").result().path
        print(f"epoch {epoch + 1}: loss per token {losses[-1]:.3f}; state saved to {state_path}")

    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode(prompt_text(HELD_OUT), add_special_tokens=True))
    params = types.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, stop=["\n"])
    sequence = sampling_client.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
    print(f"{HELD_OUT!r} in Pig Latin: {tokenizer.decode(sequence.tokens).strip()!r}")
    print(f"loss per token: first step {losses[0]:.3f} -> last step {losses[-1]:.3f}; state saved to {state_path}")
    service_client.close("success").result()


if __name__ == "__main__":
    main()
