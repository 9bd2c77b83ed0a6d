"""GRPO on image questions: builtin://qwen3-vl-tiny answers builtin://clevr-mini's scenes, rewarded for exact answers.

The recipe of cookbook/rl/grpo.py (the same loop: sample with ``TorchSampler``, reward, group advantages,
``forward_backward(old_logps=, advantages=)``, ``clip_grad_and_step``, LoRA-only weight sync), with a ``Task``
of images: ``CLEVRProcessor`` prompts (the image and a question asking for one word or number) and
``ShortAnswerReward`` (1 for the scene's answer, else 0). The randomly initialised model first gets a short
full-parameter SFT warm-up on the training scenes (saved and reused); GRPO then trains a LoRA adapter on every
linear layer, the vision tower's included, and the sampler serves that adapter on the image prompts.

    .venv/bin/python cookbook/mm/clevr_grpo.py

Knobs are grpo.py's (WARMUP_STEPS, MAX_STEPS, BATCH_SIZE, NUM_GENERATIONS, MINI_BATCH_SIZE, MAX_NEW_TOKENS,
LR, SEED, OUTPUT_DIR, DATA_ROWS), with defaults for this task.
"""

import os
import sys
from pathlib import Path

from twinkle.preprocessor import CLEVRProcessor
from twinkle.reward import ShortAnswerReward

for knob, default in {
    "MODEL_ID": "builtin://qwen3-vl-tiny",
    "OUTPUT_DIR": "outputs/clevr_grpo",
    "WARMUP_STEPS": "150",
    "MAX_STEPS": "40",
    "MAX_NEW_TOKENS": "6",
}.items():
    os.environ.setdefault(knob, default)  # before the recipe reads them
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))  # the in-process recipe

from grpo import Task, local_components, main  # noqa: E402

CLEVR = Task(
    "clevr",
    "builtin://clevr-mini",
    lambda for_sampling: CLEVRProcessor(include_answer=not for_sampling),
    {"accuracy": ShortAnswerReward()},
)

if __name__ == "__main__":
    main(local_components(), CLEVR)
