"""GRPO on short GSM8K-style math with the unmodified ``tinker`` SDK against a Twinkle server.

Each step saves the policy's weights for sampling (``save_weights_and_get_sampling_client``),
samples NUM_GENERATIONS completions per prompt, scores them here with Twinkle's verifiable rewards
(the mean of GSM8KFormatReward and GSM8KAccuracyReward, in [0, 1]), turns them into group-normalised
GRPO advantages, and trains on the completions with Tinker's ``importance_sampling`` loss (the
sampler's log-probs as the behaviour policy). The trainer's log-probs of the sampled tokens are
compared with the sampler's at every step: they must agree, as both read the same weights. The
prompts come from Twinkle's dataset pipeline (builtin://gsm8k-mini, the base model's chat template).

The embedded tiny model is randomly initialised and LoRA-only training cannot teach it the answer
format in minutes, so its rewards stay near 0 (cookbook/rl/grpo.py first fine-tunes all its
weights, which the Tinker API does not offer); serve a real model (``model_id`` in the server
config) for a rising curve. Start a server and create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/tinker/self_host/short_math_grpo.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. Knobs: MAX_STEPS, BATCH_SIZE (prompts per step),
NUM_GENERATIONS, MAX_NEW_TOKENS, LR, LORA_RANK, SEED, MODEL_ID (the server's base model).
"""

import itertools
import os

from tqdm import tqdm

from twinkle import init_tinker_client
from twinkle.advantage import GRPOAdvantage
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.metric import LogprobMismatchMetric
from twinkle.preprocessor import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.template import Template

init_tinker_client()  # TINKER_BASE_URL / TINKER_API_KEY from TWINKLE_BASE_URL / TWINKLE_API_KEY

from tinker import ServiceClient, types  # noqa: E402 (after init_tinker_client)

MODEL_ID = os.environ.get("MODEL_ID", "builtin://qwen3-tiny")
SEED = int(os.environ.get("SEED", 42))
MAX_STEPS = int(os.environ.get("MAX_STEPS", 20))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 4))
NUM_GENERATIONS = int(os.environ.get("NUM_GENERATIONS", 4))
MAX_NEW_TOKENS = int(os.environ.get("MAX_NEW_TOKENS", 48))
LEARNING_RATE = float(os.environ.get("LR", 5e-4))
LORA_RANK = int(os.environ.get("LORA_RANK", 16))


def create_dataloader() -> DataLoader:
    """Prompts only (the answer stays in ``user_data`` for the rewards); no system prompt, to keep them short."""
    dataset = Dataset(DatasetMeta("builtin://gsm8k-mini"))
    dataset.set_template("Template", model_id=MODEL_ID, max_length=256, enable_thinking=False)
    dataset.map(GSM8KProcessor(system=None))
    dataset.encode(add_generation_prompt=True)
    return DataLoader(dataset=dataset, batch_size=BATCH_SIZE, shuffle=True, seed=SEED)


def completion_datum(prompt: list[int], completion: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """The prompt and its completion as one datum; only the completion's tokens carry an advantage."""
    tokens = prompt + completion
    padding = [0.0] * (len(prompt) - 1)  # positions predicting prompt tokens: no advantage, no gradient
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": padding + list(logprobs),
            "advantages": padding + [advantage] * len(completion),
        },
    )


def main() -> None:
    dataloader = create_dataloader()
    template = Template(MODEL_ID, enable_thinking=False)
    service_client = ServiceClient()
    training_client = service_client.create_lora_training_client(
        base_model=MODEL_ID, rank=LORA_RANK, seed=SEED
    ).result()
    reward_fns, advantage_fn = (GSM8KAccuracyReward(), GSM8KFormatReward()), GRPOAdvantage()
    reward_curve: list[float] = []
    mismatch = 0.0  # the largest |sampler - trainer| log-prob of a sampled token so far
    batches = (batch for _ in itertools.count() for batch in dataloader)  # epoch after epoch
    progress = tqdm(total=MAX_STEPS, desc="GRPO")
    while len(reward_curve) < MAX_STEPS:
        prompts = next(batches)
        sampler = training_client.save_weights_and_get_sampling_client().result()  # the current policy
        params = types.SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=SEED + len(reward_curve))
        futures = [  # every prompt is sent before the first completions are awaited
            sampler.sample(types.ModelInput.from_ints(list(p["input_ids"])), NUM_GENERATIONS, params) for p in prompts
        ]
        samples = []  # (prompt, sampled sequence), prompt-major: each prompt's group is contiguous
        for prompt, future in zip(prompts, futures, strict=True):
            samples += [(prompt, sequence) for sequence in future.result().sequences]
        trajectories = [
            {"completion": template.decode(s.tokens, skip_special_tokens=True), "user_data": p["user_data"]}
            for p, s in samples
        ]
        scores = [fn(trajectories) for fn in reward_fns]
        total = [sum(values) / len(values) for values in zip(*scores, strict=True)]
        advantages = advantage_fn(total, num_generations=NUM_GENERATIONS, scale="group").tolist()
        data = [
            completion_datum(list(p["input_ids"]), list(s.tokens), list(s.logprobs), advantage)
            for (p, s), advantage in zip(samples, advantages, strict=True)
        ]
        fwdbwd_future = training_client.forward_backward(data, "importance_sampling")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE, grad_clip_norm=1.0))
        fwdbwd, _ = fwdbwd_future.result(), optim_future.result()
        metric = LogprobMismatchMetric()  # the trainer's log-probs of the sampled tokens, before this step's update
        metric.accumulate(
            sampler_logps=[list(s.logprobs) for _, s in samples],
            trainer_logps=[
                output["logprobs"].to_numpy()[len(p["input_ids"]) - 1 :].tolist()
                for output, (p, _) in zip(fwdbwd.loss_fn_outputs, samples, strict=True)
            ],
        )
        mismatch = max(mismatch, metric.calculate()["logprob_mismatch/max_abs"])
        reward_curve.append(sum(total) / len(total))
        progress.update()
        progress.set_postfix(reward=f"{reward_curve[-1]:.2f}")
    progress.close()
    path = training_client.save_weights_for_sampler("grpo-gsm8k").result().path
    first, last = reward_curve[:10], reward_curve[-10:]
    print(f"last completion: {trajectories[-1]['completion']!r}")
    print(
        f"mean reward: first 10 steps {sum(first) / len(first):.3f} -> last 10 steps {sum(last) / len(last):.3f}; "
        f"sampler/trainer logprob mismatch max {mismatch:.2e}; adapter saved to {path}"
    )
    service_client.close("success").result()


if __name__ == "__main__":
    main()
