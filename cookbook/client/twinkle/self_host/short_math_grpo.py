"""GRPO on short GSM8K-style math on a Twinkle server: the recipe of cookbook/rl/grpo.py, run remotely.

The loop is the in-process cookbook's own ``main``; only the classes it builds come from
``twinkle_client`` (no torch needed here). Sampling, training and the weight sync happen on the
server; rewards, advantages and metrics are computed here. Start a server and create a user, which
prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/twinkle/self_host/short_math_grpo.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. The knobs are the recipe's: WARMUP_STEPS,
MAX_STEPS, BATCH_SIZE, NUM_GENERATIONS, MINI_BATCH_SIZE, MICRO_BATCH_SIZE, MAX_NEW_TOKENS, LR, SEED,
and MODEL_ID, which must name the server's base model.

As in-process, the SFT warm-up trains all weights (a full-parameter run, with its own copy of the
model on the server) and GRPO trains a LoRA adapter on the warm-up checkpoint, which stays in the
server's checkpoint store; the ``checkpoint-path`` marker written under OUTPUT_DIR holds its
``twinkle://`` path for the next run. (A LoRA warm-up is no substitute: on the randomly initialised
tiny model its loss is still 6.6-7.9 after 120 steps, against 3.0 after 60 for full fine-tuning,
and no completion earns a reward.)
"""

import os
import sys
from pathlib import Path

from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.checkpoint_engine import CheckpointEngineManager
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import TransformersModel
from twinkle_client.sampler import TorchSampler

# Its own outputs: the warm-up marker here holds a server path, the in-process one a local folder.
os.environ.setdefault("OUTPUT_DIR", "outputs/client/twinkle/grpo")  # before the recipe reads it
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "rl"))  # the in-process recipe
import grpo


def main() -> None:
    init_twinkle_client()  # TWINKLE_BASE_URL, TWINKLE_API_KEY
    grpo.main(
        grpo.Components(
            LoraConfig=LoraConfig,
            Dataset=Dataset,
            DatasetMeta=DatasetMeta,
            DataLoader=DataLoader,
            TransformersModel=TransformersModel,
            TorchSampler=TorchSampler,
            CheckpointEngineManager=CheckpointEngineManager,
        )
    )


if __name__ == "__main__":
    main()
