"""Sampling throughput of ``TorchSampler`` against transformers ``generate``, and the cost of a weight sync.

(1) **Sampling.** Both sides sample completions for the same 16 chat prompts
(GSM8K questions encoded with the generation prompt) from the same model
object, with the same temperature, top-k, top-p and ``max_tokens``:
``TorchSampler.sample(prompts, SamplingParams(...))`` against
``model.generate(do_sample=True, ...)`` on the left-padded batch. The sides
take turns, the one going first alternating, and the median generated tokens/s
over the rounds is reported. The target is a ratio of 1.5 or more for the RL
default (temperature 1, no top-k, no top-p). On the default 152k-vocabulary
model most of a decode step is spent choosing the token, which ``generate``
does with full-vocabulary logits processors and ``torch.multinomial``; the
sampler draws one uniform number per row instead (inverse-CDF search, see
``twinkle.sampler.token_sampling``).

The comparison is fair in these ways: one model object for both (float32,
sdpa attention, its own ``generate`` KV cache); the same end-of-sequence ids;
tokens/s counts the tokens each side actually generated (up to and including
its end-of-sequence token); and the sampler also computes every token's
log-probability (which RL needs), work ``generate`` skips.

(2) **Calls sampled together.** ``--batch-size`` sample calls of one prompt
each, 4 seeded samples per prompt (as an RL loop's concurrent Tinker ``asample``
requests reach a server), by one ``Sampler.sample_many`` against one ``sample``
call after another; the server's scheduler batches such calls this way.

(3) **Weight sync.** A LoRA (r=16, all linear layers) trainer is synced into a
sampler by ``CheckpointEngineManager.sync_weights``: LoRA only (the adapter's
tensors) against merged full weights (every base weight, ``W + scaling·B·A``).

``--vllm`` adds ``vLLMSampler`` (fp32, in-process engine) as a third side of
(1) and a second sampler in (2) and (3); it needs vllm (``.venv-vllm`` from ``make
test-vllm`` has the CPU build). vLLM's CPU attention runs no heads smaller than
32, so on a CPU the default model is replaced, for every side, by the same tiny
Qwen3 with heads 32 wide (``builtin://qwen3-tiny-head32``).

Run it from the repository root:

    python tools/bench/sampler.py            # about 2 minutes on 2 idle CPU cores
    python tools/bench/sampler.py --quick    # a smoke run
    .venv-vllm/bin/python tools/bench/sampler.py --quick --vllm

One CPU run
(``--quick --vllm --threads 1``, 2 busy cores): RL default 748 / 235 / 650
tokens/s (TorchSampler / generate / vLLM), top-k 50 + top-p 0.9 689 / 114 / 61;
sync into vLLM 7.4 ms LoRA-only against 88 ms merged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from peft import LoraConfig
from transformers.utils.logging import disable_progress_bar

from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.data_format import SamplingParams
from twinkle.hub import resolve_dataset
from twinkle.model import TransformersModel
from twinkle.sampler import SampleCall, TorchSampler
from twinkle.template import Template

MODEL_ID = "builtin://qwen3-tiny"
CASES = (
    ("RL default: temperature 1, no top-k, no top-p", SamplingParams(temperature=1.0), 1.5),
    ("temperature 0.7, top-k 50, top-p 0.9", SamplingParams(temperature=0.7, top_k=50, top_p=0.9), None),
)

Side = Callable[[], int]  # one batch of sampling; returns the number of generated tokens


def chat_prompts(template: Template, count: int) -> list[dict]:
    path = os.path.join(resolve_dataset("builtin://gsm8k-mini"), "train.jsonl")
    with open(path, encoding="utf-8") as handle:
        rows = [json.loads(line) for _, line in zip(range(count), handle, strict=False)]
    return [
        template.encode({"messages": [{"role": "user", "content": row["question"]}]}, add_generation_prompt=True)
        for row in rows
    ]


def sampler_side(sampler: Any, prompts: list[dict], params: SamplingParams) -> Side:
    def run() -> int:
        return sum(len(sequence.tokens) for sequence in sampler.sample(prompts, params).sequences)

    return run


def generate_side(sampler: TorchSampler, prompts: list[dict], params: SamplingParams) -> Side:
    """``generate`` on the sampler's own model (no adapters are injected here, so it is the plain HF model)."""
    width = max(len(p["input_ids"]) for p in prompts)
    pad = sampler.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p["input_ids"])) + p["input_ids"] for p in prompts])
    attention_mask = (
        torch.arange(width) >= width - torch.tensor([len(p["input_ids"]) for p in prompts])[:, None]
    ).long()
    eos = set(sampler.eos_token_ids)

    def run() -> int:
        with torch.inference_mode():
            output = sampler.model.generate(
                input_ids=input_ids.to(sampler.device),
                attention_mask=attention_mask.to(sampler.device),
                do_sample=True,
                temperature=params.temperature,
                top_k=0 if params.top_k == -1 else params.top_k,  # 0 disables it in transformers
                top_p=params.top_p,
                max_new_tokens=params.max_tokens,
                eos_token_id=sorted(eos),
                pad_token_id=pad,
            )
        generated = 0
        for row in output[:, width:].tolist():
            ends = [i for i, token in enumerate(row) if token in eos]
            generated += ends[0] + 1 if ends else len(row)
        return generated

    return run


def interleaved(sides: dict[str, Side], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Tokens/s of each side per round; the sides take turns and the first one alternates."""
    for _ in range(warmup):
        for side in sides.values():
            side()
    speeds: dict[str, list[float]] = {name: [] for name in sides}
    for index in range(rounds):
        for name in list(sides) if index % 2 == 0 else list(reversed(sides)):
            start = time.perf_counter()
            tokens = sides[name]()
            speeds[name].append(tokens / (time.perf_counter() - start))
    return speeds


def bench_sampling(args: argparse.Namespace) -> None:
    sampler = TorchSampler(args.model, device=args.device)
    template = Template(sampler.model_path, max_length=None)
    sampler.set_template(template)
    prompts = chat_prompts(template, args.batch_size)
    lengths = [len(p["input_ids"]) for p in prompts]
    shape = f"{args.batch_size} prompts ({min(lengths)}..{max(lengths)} tokens), {args.max_tokens} new tokens"
    print(f"\n(1) sampling {shape}")
    for title, base_params, target in CASES:
        params = SamplingParams(**{**base_params.to_dict(), "max_tokens": args.max_tokens})
        sides = {"sampler": sampler_side(sampler, prompts, params), "generate": generate_side(sampler, prompts, params)}
        if args.vllm:
            sides["vllm"] = sampler_side(vllm_sampler(args.model), prompts, params)
        speeds = interleaved(sides, args.rounds, args.warmup)
        median = {name: statistics.median(values) for name, values in speeds.items()}
        ratio = median["sampler"] / median["generate"]
        verdict = "" if target is None else f"  ({'meets' if ratio >= target else 'BELOW'} the target >= {target})"
        print(f"  {title}")
        labels = {"sampler": "TorchSampler.sample", "generate": "transformers generate", "vllm": "vLLMSampler.sample"}
        for name in speeds:
            rounds = ", ".join(f"{value:.0f}" for value in speeds[name])
            print(f"    {labels[name]:<22} {median[name]:>7.0f} tokens/s   (rounds: {rounds})")
        print(f"    ratio sampler / generate: {ratio:.2f}{verdict}")
        if "vllm" in median:
            print(
                f"    ratio vLLM / generate: {median['vllm'] / median['generate']:.2f}, vLLM / TorchSampler: "
                f"{median['vllm'] / median['sampler']:.2f}"
            )


def bench_calls(args: argparse.Namespace) -> None:
    sampler = TorchSampler(args.model, device=args.device)
    template = Template(sampler.model_path, max_length=None)
    prompts = chat_prompts(template, args.batch_size)
    print(f"\n(2) {args.batch_size} sample calls of one prompt, 4 samples each, {args.max_tokens} new tokens")
    samplers = {"TorchSampler": sampler, **({"vLLMSampler": vllm_sampler(args.model)} if args.vllm else {})}
    for label, each in samplers.items():
        calls = [
            SampleCall(prompt, SamplingParams(max_tokens=args.max_tokens, num_samples=4, seed=index))
            for index, prompt in enumerate(prompts)
        ]

        def together(each: Any = each, calls: list[SampleCall] = calls) -> int:
            return sum(len(s.tokens) for result in each.sample_many(calls) for s in result.unwrap().sequences)

        def one_by_one(each: Any = each, calls: list[SampleCall] = calls) -> int:
            responses = [each.sample(call.inputs, call.sampling_params) for call in calls]
            return sum(len(s.tokens) for response in responses for s in response.sequences)

        speeds = interleaved({"together": together, "one by one": one_by_one}, args.rounds, args.warmup)
        median = {name: statistics.median(values) for name, values in speeds.items()}
        print(f"  {label}")
        for name, values in speeds.items():
            rounds = ", ".join(f"{value:.0f}" for value in values)
            print(f"    {name:<22} {median[name]:>7.0f} tokens/s   (rounds: {rounds})")
        print(f"    ratio together / one by one: {median['together'] / median['one by one']:.2f}")


_VLLM_SAMPLERS: dict[tuple[str, bool], Any] = {}


def vllm_sampler(model: str, enable_lora: bool = False) -> Any:
    """One in-process fp32 engine per model and LoRA setting, shared by the cases."""
    if (model, enable_lora) not in _VLLM_SAMPLERS:
        from twinkle.sampler import vLLMSampler

        engine_args: dict[str, Any] = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
        if enable_lora:
            engine_args.update(enable_lora=True, max_lora_rank=16, max_loras=2)
        sampler = vLLMSampler(model, engine_args=engine_args)
        sampler.set_template(Template(sampler.model_path, max_length=None))
        _VLLM_SAMPLERS[model, enable_lora] = sampler
    return _VLLM_SAMPLERS[model, enable_lora]


def vllm_ready_model(model: str, device: torch.device) -> str:
    """``model``, or on a CPU for the default model its build with heads 32 wide (vLLM's CPU attention minimum)."""
    if model != MODEL_ID or device.type != "cpu":
        return model
    return "builtin://qwen3-tiny-head32"


def bench_sync(args: argparse.Namespace) -> None:
    model = TransformersModel(args.model, device=args.device)
    model.add_adapter_to_model("policy", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    lora_bytes = sum(p.numel() * p.element_size() for n, p in model.model.named_parameters() if "lora_" in n)
    full_bytes = sum(p.numel() * p.element_size() for n, p in model.model.named_parameters() if "lora_" not in n)
    time_sync(args, CheckpointEngineManager(model, TorchSampler(args.model, device=args.device)), "TorchSampler")
    if args.vllm:
        time_sync(args, CheckpointEngineManager(model, vllm_sampler(args.model, enable_lora=True)), "vLLMSampler")
    print(f"    LoRA-only sync moves {lora_bytes / 2**20:.2f} MiB, merged {full_bytes / 2**20:.2f} MiB")


def time_sync(args: argparse.Namespace, manager: CheckpointEngineManager, label: str) -> None:
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for index in range(args.rounds + args.warmup):
        for merge in (False, True) if index % 2 == 0 else (True, False):
            start = time.perf_counter()
            manager.sync_weights(merge_and_sync=merge)
            if index >= args.warmup:
                seconds[merge].append(time.perf_counter() - start)
    lora, full = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"\n(3) sync_weights into {label}, LoRA r=16 on all linear layers")
    print(f"    LoRA only      {lora * 1e3:>8.2f} ms")
    print(f"    merged, full   {full * 1e3:>8.2f} ms")
    print(f"    LoRA-only sync is {full / lora:.1f}x faster")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side; the median is reported")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per side first")
    parser.add_argument("--model", default=MODEL_ID, help="any id twinkle.hub.resolve_model accepts")
    parser.add_argument("--device", type=torch.device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: left as is); 1 is steadier on a busy machine",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 16 new tokens, 2 rounds")
    parser.add_argument("--vllm", action="store_true", help="also vLLMSampler (needs vllm, e.g. .venv-vllm)")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens, args.rounds = 16, 2
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.vllm:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        args.model = vllm_ready_model(args.model, args.device)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    disable_progress_bar()  # weight-loading bars would interleave with the results
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # raised inside PEFT, not ours
    print(
        f"model {args.model} on {args.device} (float32, {torch.get_num_threads()} threads); "
        f"{args.warmup} warm-up round(s), then {args.rounds} rounds per side; "
        f"load average {os.getloadavg()[0]:.1f} (other processes make the absolute numbers noisy)"
    )
    bench_sampling(args)
    bench_calls(args)
    bench_sync(args)


if __name__ == "__main__":
    main()
