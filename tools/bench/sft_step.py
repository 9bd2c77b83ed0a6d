"""Throughput of Twinkle's LoRA SFT step against a hand-written transformers + PEFT loop.

Twinkle wraps the training step in semantic calls (``forward_backward`` then
``clip_grad_and_step``). Those calls validate and collate the batch, run the
decoder, compute log-probabilities only where there are labels, reduce the
loss and record metrics. This script checks what that costs. It trains the
same model on the same batches, side by side in one process, with the loop
most people would write by hand:

    loss = model(input_ids, attention_mask, labels=labels).loss
    loss.backward(); clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad()

It measures two cases:

(a) **fixed-length batches** (every sequence exactly ``--length`` tokens, so
    nobody pads). Twinkle uses its default padded ``InputProcessor``. Twinkle
    should be at least as fast as the hand-written loop; the target is a ratio
    of 0.95 or more.
(b) **variable-length batches** (lengths spread over ``--min-length`` to
    ``--max-length``). Twinkle packs the batch into one row with no padding
    (``set_processor('InputProcessor', padding_free=True)``); the hand-written
    loop right-pads as usual. The target is a ratio of 1.3 or more.

The data is realistic chat SFT data: multi-turn conversations built from the
embedded self-cognition and GSM8K (with solutions) sets, encoded by
``twinkle.template.Template``, with labels only on assistant tokens (see
``sft_data.py``).

What to expect: the default model has a 152k-token vocabulary on a tiny
decoder, so the output layer is most of the step. Twinkle runs it only on
labelled positions; the plain loop runs it on every position, padding
included. ``--label-all`` labels every token, which is Twinkle's worst case.

The comparison is fair in these ways:

- Both sides use the same model, dtype (float32), attention implementation
  (sdpa), LoRA config, LoRA initialisation (same seed), AdamW settings and
  gradient clipping.
- The baseline also gets ``use_cache=False``, so it does not fill a KV cache
  it never reads. This only makes the baseline faster.
- Both sides run the same warm-up steps and then see the same batches in
  the same order. They take turns step by step, the side that goes first
  alternating, so load from other processes hits both alike. The reported
  figure is the median over rounds. ``torch.set_num_threads`` is left as it is.
- Tokens/s counts the same real (non-pad) tokens for both sides, and the
  timer covers the whole step from the raw features on: collation is part
  of either side's step.
- The two models start from identical weights and see identical batches,
  so they must compute identical losses. The script prints the largest loss
  difference as evidence that both do the same work.

Run it from the repository root:

    python tools/bench/sft_step.py            # the full benchmark (about 2 minutes on 2 idle CPU cores)
    python tools/bench/sft_step.py --quick    # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch
from peft import LoraConfig, get_peft_model
from sft_data import SEED, Batch, fixed_length_batches, label_everything, real_tokens, variable_length_batches
from transformers import AutoModelForCausalLM
from transformers.utils.logging import disable_progress_bar

from twinkle.data_format import IGNORE_INDEX
from twinkle.hub import resolve_model
from twinkle.model import TransformersModel
from twinkle.template import Template

MODEL_ID = "builtin://qwen3-tiny"
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
SIDES = ("twinkle", "plain")
LABELS = {"twinkle": "Twinkle", "plain": "transformers+PEFT"}

Step = Callable[[Batch], float]  # one training step on raw features; returns the loss


def lora_config() -> LoraConfig:
    """A new config for each model: PEFT mutates the config it is given."""
    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")


# ---------------------------------------------------------------------------- the two training steps


def twinkle_step(model_dir: str, device: torch.device, padding_free: bool) -> Step:
    """Twinkle's step: ``forward_backward(inputs=batch)`` then ``clip_grad_and_step()``."""
    model = TransformersModel(model_dir, device=device)
    torch.manual_seed(SEED)
    model.add_adapter_to_model("bench", lora_config())
    model.set_optimizer("AdamW", lr=LEARNING_RATE)
    if padding_free:
        model.set_processor("InputProcessor", padding_free=True)

    def step(batch: Batch) -> float:
        loss = model.forward_backward(inputs=batch).loss
        model.clip_grad_and_step(MAX_GRAD_NORM)
        return loss

    return step


def plain_step(model_dir: str, device: torch.device) -> Step:
    """The hand-written loop: right-pad, forward with ``labels=``, backward, clip, AdamW step, zero grads."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(SEED)
    model = get_peft_model(base.to(device), lora_config())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE)
    pad_token_id = base.config.pad_token_id or 0

    def step(batch: Batch) -> float:
        loss = model(
            input_ids=right_pad(batch, "input_ids", pad_token_id, device),
            attention_mask=right_pad(batch, "attention_mask", 0, device),
            labels=right_pad(batch, "labels", IGNORE_INDEX, device),
            use_cache=False,
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return step


def right_pad(batch: Batch, key: str, value: int, device: torch.device) -> torch.Tensor:
    """``[B, T]`` tensor of field ``key``, every row padded with ``value`` to the longest one."""
    width = max(len(feature[key]) for feature in batch)
    return torch.tensor([feature[key] + [value] * (width - len(feature[key])) for feature in batch], device=device)


# ---------------------------------------------------------------------------- measuring


def timed_step(step: Step, batch: Batch, device: torch.device) -> tuple[float, float]:
    """``(seconds, loss)`` of one step; on a GPU the clock stops when the device is done."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    loss = step(batch)
    synchronize()
    return time.perf_counter() - start, loss


def run_interleaved(
    steps: dict[str, Step], batches: list[Batch], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``(tokens/s per round, loss per step)`` of each side, the sides taking turns step by step.

    A round is one pass over ``batches`` for each side; on each batch both
    sides run, and which one goes first alternates. A burst of load from
    other processes therefore hits both sides alike.
    """
    losses: dict[str, list[float]] = {name: [] for name in steps}
    for batch in itertools.islice(itertools.cycle(batches), args.warmup):
        for name, step in steps.items():
            losses[name].append(step(batch))
    speeds: dict[str, list[float]] = {name: [] for name in steps}
    tokens = sum(real_tokens(batch) for batch in batches)
    for round_index in range(args.rounds):
        seconds = dict.fromkeys(steps, 0.0)
        for batch_index, batch in enumerate(batches):
            order = list(steps) if (round_index + batch_index) % 2 == 0 else list(reversed(steps))
            for name in order:
                elapsed, loss = timed_step(steps[name], batch, args.device)
                seconds[name] += elapsed
                losses[name].append(loss)
        for name in steps:
            speeds[name].append(tokens / seconds[name])
    return speeds, losses


def report(
    title: str, batches: list[Batch], speeds: dict[str, list[float]], losses: dict[str, list[float]], target: float
) -> None:
    """Print the data's shape, each side's median tokens/s, their ratio against ``target``, and the loss check."""
    lengths = [len(feature["input_ids"]) for batch in batches for feature in batch]
    padded = sum(max(len(feature["input_ids"]) for feature in batch) * len(batch) for batch in batches)
    labelled = sum(label != IGNORE_INDEX for batch in batches for feature in batch for label in feature["labels"])
    print(f"\n{title}")
    print(
        f"  data: {len(batches)} batches x {len(batches[0])}, lengths {min(lengths)}..{max(lengths)} "
        f"(mean {statistics.mean(lengths):.0f}), {labelled / sum(lengths):.0%} of tokens labelled, "
        f"{1 - sum(lengths) / padded:.0%} of the plain loop's positions are padding"
    )
    median = {name: statistics.median(values) for name, values in speeds.items()}
    for name in SIDES:
        rounds = ", ".join(f"{value:.0f}" for value in speeds[name])
        print(f"  {LABELS[name]:<18} {median[name]:>9.0f} tokens/s   (rounds: {rounds})")
    ratio = median["twinkle"] / median["plain"]
    best_ratio = max(speeds["twinkle"]) / max(speeds["plain"])
    verdict = "meets" if ratio >= target else "BELOW"
    print(f"  ratio Twinkle / plain: {ratio:.2f}   ({verdict} the target >= {target}; best rounds: {best_ratio:.2f})")
    gap = max(abs(a - b) for a, b in zip(losses["twinkle"], losses["plain"], strict=True))
    print(f"  same losses on both sides: max |diff| {gap:.1e} over {len(losses['plain'])} steps")


# ---------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round (distinct batches)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per side; the median is reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the rounds")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=256, help="sequence length of case (a)")
    parser.add_argument("--min-length", type=int, default=32, help="shortest target length of case (b)")
    parser.add_argument("--max-length", type=int, default=512, help="longest target length of case (b)")
    parser.add_argument("--model", default=MODEL_ID, help="any id twinkle.hub.resolve_model accepts")
    parser.add_argument("--device", type=torch.device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--label-all",
        action="store_true",
        help="label prompt tokens too (Twinkle then cannot skip them in the output layer)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 step, 2 rounds, 1 warm-up, short data")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup = 1, 2, 1
        args.length, args.max_length = 64, 128
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    disable_progress_bar()  # weight-loading bars would interleave with the results
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # raised inside PEFT, not ours
    model_dir = resolve_model(args.model)
    template = Template(model_dir, max_length=None)
    print(
        f"model {args.model} on {args.device} (float32, {torch.get_num_threads()} threads), LoRA r=16 all-linear; "
        f"{args.warmup} warm-up steps, then {args.rounds} rounds x {args.steps} steps per side; "
        f"load average {os.getloadavg()[0]:.1f} (other processes make the absolute numbers noisy)"
    )
    cases = [
        (
            f"(a) fixed length {args.length}: Twinkle padded vs transformers+PEFT",
            fixed_length_batches(template, args.length, args.batch_size, args.steps),
            False,
            0.95,
        ),
        (
            f"(b) lengths {args.min_length}..{args.max_length}: Twinkle padding-free vs transformers+PEFT right-padded",
            variable_length_batches(template, args.min_length, args.max_length, args.batch_size, args.steps),
            True,
            1.3,
        ),
    ]
    for title, batches, padding_free, target in cases:
        if args.label_all:
            label_everything(batches)
        steps = {
            "twinkle": twinkle_step(model_dir, args.device, padding_free),
            "plain": plain_step(model_dir, args.device),
        }
        speeds, losses = run_interleaved(steps, batches, args)
        report(title, batches, speeds, losses, target)


if __name__ == "__main__":
    main()
