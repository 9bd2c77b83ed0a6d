"""Time per GRPO global batch: Twinkle's in-process loop against TRL's ``GRPOTrainer``.

One global batch is ``--prompts`` GSM8K-style prompts x ``--generations``
sampled completions of up to ``--max-new-tokens`` tokens, scored by the same
verifiable rewards, turned into group-normalised advantages and used for one
clipped policy-gradient optimizer step on a LoRA adapter:

- **Twinkle**: the loop of ``cookbook/rl/grpo.py``: ``sync_weights`` (LoRA
  tensors) -> ``TorchSampler.sample`` (log-probs come with the tokens) ->
  rewards -> ``GRPOAdvantage`` -> ``forward_backward(old_logps=...,
  advantages=...)`` -> ``clip_grad_and_step``.
- **TRL**: ``GRPOTrainer`` with the same model directory, LoRA config, prompts,
  reward functions, batch, generation length, temperature and learning rate;
  generation through ``model.generate`` (no vLLM on a CPU).

How it stays fair:

- Both start from the same weights (the embedded ``builtin://qwen3-tiny``,
  float32, sdpa attention) with LoRA r=16, alpha 32, all linear layers, no
  dropout, AdamW at the same learning rate, gradient clipping at 1.0, no KL term
  (TRL's ``beta=0``) and no gradient checkpointing (TRL's default turns it on,
  which would only slow TRL down).
- The untrained model almost never emits its end-of-turn token, so both sides
  generate the full ``--max-new-tokens`` for every completion; the mean
  completion lengths are printed as evidence that both did the same work. Its
  rewards are all 0, so advantages are 0, but neither side skips any work for
  that: both run the full forward, backward and optimizer step.
- The sides take turns step by step: a TRL callback runs one Twinkle step
  after each TRL step, so machine load hits both alike. The first
  ``--warmup`` steps of each side are not timed.

Run it from the repository root (TRL is not a workspace dependency):

    pip install -r tools/bench/requirements.txt
    python tools/bench/grpo_vs_trl.py            # about 5 minutes on 2 idle CPU cores
    python tools/bench/grpo_vs_trl.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable

from peft import LoraConfig

from twinkle.advantage import GRPOAdvantage
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.hub import resolve_model
from twinkle.model import TransformersModel
from twinkle.preprocessor import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward
from twinkle.sampler import TorchSampler

MODEL_ID = "builtin://qwen3-tiny"
TARGET_RATIO = 1.2
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
LEARNING_RATE = 1e-5  # small, so that neither side's policy drifts to short answers during the run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per global batch")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=4, help="timed global batches per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed global batches per side first")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 4, 8 tokens, 2 steps")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.generations, args.max_new_tokens, args.steps = 2, 4, 8, 2
    return args


def rewards(trajectories: list[dict]) -> list[float]:
    """The cookbook's reward: mean of answer format and accuracy, in [0, 1]."""
    accuracy, format_ = GSM8KAccuracyReward()(trajectories), GSM8KFormatReward()(trajectories)
    return [(a + f) / 2 for a, f in zip(accuracy, format_, strict=True)]


def questions(count: int) -> list[dict]:
    """The first ``count`` gsm8k-mini rows as ``{question, answer}``."""
    dataset = Dataset(DatasetMeta("builtin://gsm8k-mini"))
    return [dataset[index] for index in range(count)]


class TwinkleGRPO:
    """One GRPO global batch per ``step()``: the loop of ``cookbook/rl/grpo.py``."""

    def __init__(self, model_dir: str, rows: list[dict], args: argparse.Namespace) -> None:
        self.model = TransformersModel(model_id=model_dir)
        self.model.add_adapter_to_model("default", LoraConfig(**LORA))
        self.model.set_optimizer("AdamW", lr=LEARNING_RATE)
        self.model.set_loss("GRPOLoss", epsilon=0.2)
        self.sampler = TorchSampler(model_id=model_dir)
        self.sync = CheckpointEngineManager(model=self.model, sampler=self.sampler)
        dataset = Dataset(DatasetMeta(data=rows))
        dataset.set_template("Template", model_id=model_dir, enable_thinking=False)
        dataset.map(GSM8KProcessor(system=None))
        dataset.encode(add_generation_prompt=True)
        self.prompts = [dataset[index] for index in range(len(dataset))]  # step k takes the k-th slice
        self.args = args
        self.completion_lengths: list[float] = []

    def step(self, seed: int) -> float:
        """Run one global batch and return its wall time in seconds."""
        started = time.perf_counter()
        self.sync.sync_weights(merge_and_sync=False)
        params = SamplingParams(max_tokens=self.args.max_new_tokens, temperature=1.0, seed=seed)
        first = (seed * self.args.prompts) % len(self.prompts)
        prompts = self.prompts[first : first + self.args.prompts]
        response = self.sampler.sample(prompts, params, adapter_name="default", num_samples=self.args.generations)
        inputs = [sequence.new_input_feature for sequence in response.sequences]
        advantages = GRPOAdvantage()(rewards(inputs), num_generations=self.args.generations, scale="group")
        self.model.forward_backward(
            inputs=inputs,
            old_logps=[sequence.logprobs for sequence in response.sequences],
            advantages=advantages.tolist(),
        )
        self.model.clip_grad_and_step(max_grad_norm=1.0)
        elapsed = time.perf_counter() - started
        self.completion_lengths.append(statistics.mean(len(s.tokens) for s in response.sequences))
        return elapsed


def trl_trainer(model_dir: str, rows: list[dict], args: argparse.Namespace, output_dir: str):
    """A ``GRPOTrainer`` whose every optimizer step is one global batch of the same shape."""
    from datasets import Dataset as HFDataset
    from trl import GRPOConfig, GRPOTrainer

    def reward_fn(prompts: list, completions: list, answer: list[str], **_: object) -> list[float]:
        return rewards(
            [
                {"completion": completion[0]["content"], "user_data": {"answer": reference}}
                for completion, reference in zip(completions, answer, strict=True)
            ]
        )

    dataset = HFDataset.from_list(
        [{"prompt": [{"role": "user", "content": row["question"]}], "answer": row["answer"]} for row in rows]
    )
    config = GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        max_steps=args.warmup + args.steps,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        temperature=1.0,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        chat_template_kwargs={"enable_thinking": False},
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=reward_fn,
        args=config,
        train_dataset=dataset,
        peft_config=LoraConfig(**LORA, task_type="CAUSAL_LM"),
    )


def take_turns(trainer, after_each_step: Callable[[int], None]) -> list[float]:
    """Train TRL, timing each of its steps and calling ``after_each_step`` between them."""
    from transformers import PrinterCallback, TrainerCallback

    step_times: list[float] = []

    class TakeTurns(TrainerCallback):
        def on_step_begin(self, *_: object, **__: object) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args, state, *_: object, **__: object) -> None:
            step_times.append(time.perf_counter() - self.started)
            after_each_step(state.global_step)

    trainer.remove_callback(PrinterCallback)  # TRL's per-step log dicts; the summary below is enough
    trainer.add_callback(TakeTurns())
    trainer.train()
    return step_times


def main() -> None:
    args = parse_args()
    try:
        import trl
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -r tools/bench/requirements.txt") from None
    warnings.filterwarnings("ignore")
    model_dir = str(resolve_model(MODEL_ID))
    rows = questions(args.prompts * (args.warmup + args.steps))
    ours = TwinkleGRPO(model_dir, rows, args)
    our_times: list[float] = []
    trainer = trl_trainer(model_dir, rows, args, output_dir=os.path.join("outputs", "bench-grpo-trl"))
    print(
        f"GRPO global batch: {args.prompts} prompts x {args.generations} completions x {args.max_new_tokens} "
        f"new tokens, LoRA r={LORA['r']}; TRL {trl.__version__}; load average {os.getloadavg()[0]:.2f}"
    )
    trl_times = take_turns(trainer, lambda step: our_times.append(ours.step(seed=step)))
    trl_lengths = [
        entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry
    ]
    trl_median = statistics.median(trl_times[args.warmup :])
    our_median = statistics.median(our_times[args.warmup :])
    trl_length, our_length = statistics.mean(trl_lengths), statistics.mean(ours.completion_lengths)
    print(f"  TRL GRPOTrainer  {trl_median:7.2f} s per global batch (mean completion {trl_length:.1f} tokens)")
    print(f"  Twinkle          {our_median:7.2f} s per global batch (mean completion {our_length:.1f} tokens)")
    print(f"  ratio (TRL time / Twinkle time): {trl_median / our_median:.2f} (target >= {TARGET_RATIO})")


if __name__ == "__main__":
    main()
