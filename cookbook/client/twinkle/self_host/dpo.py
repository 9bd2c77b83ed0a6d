"""DPO on the embedded preference set on a Twinkle server: the recipe of cookbook/rl/dpo.py, run remotely.

The loop is the in-process cookbook's own ``main``; only the classes it builds come from
``twinkle_client`` (no torch needed here). The policy is a LoRA run on the server; the reference
is the frozen base model (a full-parameter run that only answers ``forward_only``). Start a server
and create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/twinkle/self_host/dpo.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. The knobs are the recipe's: EPOCHS, BATCH_SIZE
(pairs per step), BETA, LR, MAX_STEPS, EVAL_PAIRS, and MODEL_ID, which must name the server's base
model. The adapter is saved in the server's checkpoint store; loss.json is written to OUTPUT_DIR here.
"""

import os
import sys
from pathlib import Path

from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import TransformersModel

os.environ.setdefault("OUTPUT_DIR", "outputs/client/twinkle/dpo")  # before the recipe reads it
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "rl"))  # the in-process recipe
import dpo


def main() -> None:
    init_twinkle_client()  # TWINKLE_BASE_URL, TWINKLE_API_KEY
    dpo.main(
        dpo.Components(
            LoraConfig=LoraConfig,
            Dataset=Dataset,
            DatasetMeta=DatasetMeta,
            DataLoader=DataLoader,
            TransformersModel=TransformersModel,
        )
    )


if __name__ == "__main__":
    main()
