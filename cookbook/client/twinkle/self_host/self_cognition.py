"""Self-cognition LoRA SFT on a Twinkle server: the recipe of cookbook/sft/self_cognition.py, run remotely.

The training loop is the in-process cookbook's own ``main``; only the classes it builds come from
``twinkle_client`` instead of ``twinkle``/``peft`` (no torch needed here). Start a server, which serves
the embedded default model, and create a user, which prints an API key:

    twinkle server
    twinkle server add-user me

then, in another terminal:

    TWINKLE_API_KEY=<the key> python cookbook/client/twinkle/self_host/self_cognition.py

TWINKLE_BASE_URL defaults to http://127.0.0.1:8000. The knobs are the recipe's: EPOCHS, BATCH_SIZE,
MAX_STEPS, LR, MAX_NEW_TOKENS, NAME, AUTHOR, and MODEL_ID, which must name the server's base model.
The adapter is saved in the server's checkpoint store (the printed ``twinkle://`` path, which
sample.py's ADAPTER_PATH takes); loss.png and loss.json are written to OUTPUT_DIR here.
"""

import os
import sys
from pathlib import Path

from twinkle_client import LoraConfig, init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta
from twinkle_client.model import TransformersModel
from twinkle_client.template import Template

os.environ.setdefault("OUTPUT_DIR", "outputs/client/twinkle/sft-self-cognition")  # before the recipe reads it
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "sft"))  # the in-process recipe
import self_cognition


def main() -> None:
    init_twinkle_client()  # TWINKLE_BASE_URL, TWINKLE_API_KEY
    self_cognition.main(
        self_cognition.Components(
            LoraConfig=LoraConfig,
            Dataset=Dataset,
            DatasetMeta=DatasetMeta,
            DataLoader=DataLoader,
            TransformersModel=TransformersModel,
            Template=Template,
        )
    )


if __name__ == "__main__":
    main()
