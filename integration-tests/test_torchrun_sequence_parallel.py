"""Ulysses sequence parallelism over FSDP2 under ``torchrun --nproc_per_node 2`` trains exactly like one process.

The sequence-parallel cookbook, shrunk through its knobs, runs once in one
process and once split over two (every packed row's tokens halved, attention
heads exchanged): the loss curves must agree within 1e-4 over five steps.
test_torchrun_moe.py runs Ulysses padded, on the MoE builtin, with expert
parallelism and activation checkpointing, compares the saved adapters, and
checks that a group size the model's heads cannot split is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from twinkle.hub import resolve_dataset, resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_harness import CPU_ONLY, compare_cookbook_runs

COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook" / "sft" / "sequence_parallel.py"
KNOBS = {**CPU_ONLY, "EPOCHS": "1", "BATCH_SIZE": "8", "MAX_STEPS": "5", "MAX_NEW_TOKENS": "2"}


@pytest.mark.integration
def test_ulysses_over_fsdp2_matches_one_process(tmp_path):
    resolve_model("builtin://qwen3-tiny")  # built once, before several processes want it
    resolve_dataset("builtin://self-cognition")
    knobs = {**KNOBS, "MODEL_ID": "builtin://qwen3-tiny", "ULYSSES_SIZE": "1"}
    output = compare_cookbook_runs(COOKBOOK, tmp_path, knobs, {"ULYSSES_SIZE": "2"}, compare_adapters=False)
    assert "2 process(es), fsdp_size=2, ulysses_size=2)" in output, output[-2000:]
