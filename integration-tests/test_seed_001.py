"""Seed 001's Ray LoRA listing, run as the page prints it but for what this 2-CPU machine needs.

Substitutions: the model id and the dataset id (no hub downloads here: the
embedded model, and the embedded copy of ``swift/self-cognition``), the device
group (8 CUDA ranks -> 2 CPU ranks) and the mesh over it (FSDP 4 x DP 2 ->
FSDP 2). The listing stays in Ray mode. The set has fewer rows than the
listing's ``range(1000)``, so its loop of 13 steps prints only step 0's metric
(it prints every 20 steps); that it trained is checked on the adapter it saved,
whose loss on that same first batch must be below the printed one.
"""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from peft import LoraConfig

sys.path.insert(0, str(Path(__file__).parent))
from seed_listings import listing

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SUBSTITUTIONS = {
    "ms://Qwen/Qwen3.5-4B": "builtin://qwen3-tiny",
    "ms://swift/self-cognition": "builtin://self-cognition",
    "ranks=8, device_type='cuda'": "ranks=2, device_type='cpu'",
    "fsdp_size=4, dp_size=2": "fsdp_size=2, dp_size=1",
}
STEP_METRIC = re.compile(r"^Step 0/(\d+), metric: (\{.*\})$", re.MULTILINE)


def test_seed_001_ray_lora_listing_trains_and_saves_last_checkpoint(tmp_path):
    script = tmp_path / "seed_001.py"
    script.write_text(listing("001", "from peft import LoraConfig", SUBSTITUTIONS))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    printed = STEP_METRIC.search(run.stdout)
    assert printed, run.stdout[-3000:]
    steps, metric = int(printed[1]), ast.literal_eval(printed[2])
    assert steps > 1 and math.isfinite(metric["loss"]) and metric["lr"] == 0.0  # warm-up starts at 0

    checkpoint = tmp_path / "outputs" / "last-checkpoint"  # model.save's default folder, in the script's cwd
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in checkpoint.iterdir()}
    state = json.loads((checkpoint / "twinkle_state.json").read_text())
    assert state["counters"]["global_step"] == steps // 2  # gradient_accumulation_steps=2

    base, trained = _first_batch_losses(checkpoint)
    assert base == pytest.approx(metric["loss"], rel=1e-4)  # step 0 trained on the untouched model
    assert trained < base - 0.01, (base, trained)


def _first_batch_losses(checkpoint: Path) -> tuple[float, float]:
    """The loss of the listing's first batch without training (a fresh LoRA adapter is zero) and with the saved one."""
    from twinkle.dataloader import DataLoader
    from twinkle.dataset import Dataset, DatasetMeta
    from twinkle.model import TransformersModel
    from twinkle.preprocessor import SelfCognitionProcessor

    dataset = Dataset(DatasetMeta("builtin://self-cognition"))
    dataset.set_template("Template", model_id="builtin://qwen3-tiny")
    dataset.map(SelfCognitionProcessor("twinkle LLM", "ModelScope Community"))
    dataset.encode()
    first_batch = next(iter(DataLoader(dataset=dataset, batch_size=8)))
    model = TransformersModel(model_id="builtin://qwen3-tiny")
    model.add_adapter_to_model("untrained", LoraConfig(r=8, lora_alpha=32, target_modules="all-linear"))
    model.load(checkpoint, adapter_name="trained")
    return (
        model.forward_only(first_batch, adapter_name="untrained").loss,
        model.forward_only(first_batch, adapter_name="trained").loss,
    )
