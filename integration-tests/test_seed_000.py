"""Seed 000's GRPO listing, run as the page prints it but for what this 2-CPU machine needs.

It runs twice: with the listing's own ``vLLMSampler`` and ``engine_args`` (the CPU build of vLLM, in
``make test-vllm``'s venv, marker ``vllm``; ``'dtype': 'float32'`` added to them, as vLLM serves a float32
checkpoint in half precision by default), and here with ``vLLMSampler`` -> ``TorchSampler`` (without
vLLM's ``engine_args``), as this venv has no vLLM. The trainer is the listing's own ``MegatronModel``
(megatron-core, tensor-parallel size 1 here). Other substitutions (and why):

- the dataset id ``ms://modelscope/gsm8k`` (subset ``main``) -> ``builtin://gsm8k-mini`` (no hub downloads);
- device groups of ``'GPU'`` -> ``'CPU'`` ranks, and ``mixed_precision='bf16'`` -> ``'no'``: bf16 autocast
  is a GPU setting, and on CPU it would make the trainer's log-probs differ from the float32 sampler's;
- ``lora_dropout=0.05`` -> ``0.0``: in training mode dropout makes the trainer's log-probs a random function
  of the dropout mask, so they could never equal the sampler's (measured: 3e-5 after one step at lr 1e-5).

The listing stays in Ray mode. Its knobs shrink it: one CPU rank each for the model and the sampler, 2
prompts x 8 generations, one mini-batch (two micro-batches) per step.

The model id is the embedded ``builtin://qwen3-tiny`` (for vLLM, whose CPU attention runs no heads
narrower than 32, its ``builtin://qwen3-tiny-head32`` twin) after a few seconds of SFT on the first batch's
prompts, answering half the time in the ``#### <n>`` format and half the time not. The untrained model
earns no reward, so every advantage would be 0, the fresh LoRA adapter (B = 0) would never move, and
sampling the base model would be indistinguishable from sampling the policy. Here the first step's rewards
differ within a group, the adapter moves, and from the second step on a sampler that ignored the synced
adapter would be off by ~1e-3. What is checked: the run completes, and at every printed step the
trainer's log-probs equal the sampler's (``loss/abs_log_ratio_max``, GRPOLoss's largest ``|lp - old_logp|``
over the step's only mini-batch, < 1e-5). The last step is not printed: the listing breaks first.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from seed_listings import listing

pytestmark = [pytest.mark.integration, pytest.mark.slow]

pytest.importorskip("ray")

SHIM_VLLM = (
    "from twinkle.sampler import TorchSampler\n\n\n"
    "def vLLMSampler(engine_args=None, **kwargs):  # vLLM has its own venv; TorchSampler takes no engine_args\n"
    "    return TorchSampler(**kwargs)\n"
)
# vLLM serves a float32 checkpoint in half precision unless told otherwise; the trainer here runs in float32.
VLLM_FLOAT32 = {"'enable_lora': True,": "'enable_lora': True, 'dtype': 'float32',"}
SUBSTITUTIONS = {
    "'ms://modelscope/gsm8k', subset_name='main'": "'builtin://gsm8k-mini'",
    "device_type='GPU'": "device_type='CPU'",
    "mixed_precision='bf16'": "mixed_precision='no'",
    "lora_dropout=0.05": "lora_dropout=0.0",
}
MAX_STEPS, BATCH_SIZE, NUM_GENERATIONS = 4, 2, 8
KNOBS = {
    "MODEL_GPUS": "1",
    "SAMPLER_GPUS": "1",
    "MAX_STEPS": str(MAX_STEPS),
    "BATCH_SIZE": str(BATCH_SIZE),
    "NUM_GENERATIONS": str(NUM_GENERATIONS),
    "MAX_NEW_TOKENS": "16",
    "MINI_BATCH_SIZE": str(BATCH_SIZE * NUM_GENERATIONS),  # a step's completions: one mini-batch per step
    "MICRO_BATCH_SIZE": str(BATCH_SIZE * NUM_GENERATIONS // 2),
    "LR": "1e-4",
}
STEP = re.compile(r"^\[Step (\d+)/(\d+)\] (\{.*\})$", re.MULTILINE)
WARMUP_STEPS = 24


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize(
    "sampler",
    [
        "torch",
        pytest.param(
            "vllm",
            marks=[pytest.mark.vllm, pytest.mark.skipif(not _vllm_installed(), reason="`make test-vllm` runs it")],
        ),
    ],
)
def test_seed_000_grpo_listing_samples_the_policy_it_trains(tmp_path, sampler):
    shim = VLLM_FLOAT32 if sampler == "vllm" else {"from twinkle.sampler import vLLMSampler": SHIM_VLLM}
    script = tmp_path / "seed_000.py"
    script.write_text(listing("000", "import os", {**shim, **SUBSTITUTIONS}, end_marker="    main()"))
    base = "builtin://qwen3-tiny-head32" if sampler == "vllm" else "builtin://qwen3-tiny"
    env = {**os.environ, **KNOBS, "MODEL_ID": _half_formatted_model(base, tmp_path / "warm-up")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in the sampler's actor (vLLM's CPU build)
    env.pop("TRITON_INTERPRET", None)  # the kernel tests' interpreter (conftest) is no part of this run
    env.pop("RAY_ADDRESS", None)  # a private local Ray, stopped with the script
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert f"Training completed. optim_steps={MAX_STEPS}" in run.stdout

    steps = {int(step): ast.literal_eval(log) for step, total, log in STEP.findall(run.stdout)}
    assert sorted(steps) == list(range(1, MAX_STEPS)), run.stdout[-3000:]
    assert steps[1]["grad_norm"] > 0, "the first step must move the adapter, or nothing tells policy from base"
    mismatch = {step: log["loss/abs_log_ratio_max"] for step, log in steps.items()}
    print(f"seed 000 with {sampler}: sampler/trainer log-prob mismatch by step {mismatch}")
    assert all(value < 1e-5 for value in mismatch.values()), mismatch
    assert steps[1]["num_completions"] == BATCH_SIZE * NUM_GENERATIONS


def _half_formatted_model(base: str, directory: Path) -> str:
    """``base`` trained to answer the listing's first prompts in the GSM8K format half the time."""
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.model import TransformersModel
    from twinkle.preprocessor import GSM8KProcessor

    dataset = Dataset(DatasetMeta("builtin://gsm8k-mini", split="train", data_slice=range(BATCH_SIZE)))
    dataset.map(GSM8KProcessor())  # the listing's prompts: its system prompt, its first batch's questions
    conversations = []
    for row in (dataset[i] for i in range(len(dataset))):
        answer = row["user_data"]["answer"]
        for reply in (f"Let me think.\n#### {answer}", f"Let me think. {answer}"):  # with and without the format
            conversations.append({"messages": [*row["messages"], {"role": "assistant", "content": reply}]})
    model = TransformersModel(base)
    model.set_template("Template", max_length=2048)
    model.set_optimizer("AdamW", lr=3e-3)
    for _ in range(WARMUP_STEPS):
        model.forward_backward(inputs=conversations)
        model.clip_grad_and_step()
    return model.save("half-formatted", output_dir=directory, save_optimizer=False)
