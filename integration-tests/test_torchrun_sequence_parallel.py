"""Ulysses sequence parallelism over FSDP2 under ``torchrun --nproc_per_node 2`` trains exactly like one process.

The sequence-parallel cookbook, shrunk through its knobs, runs once in one
process and once split over two (every packed row's tokens halved, attention
heads exchanged): the loss curves must agree within 1e-4 over five steps, and
the adapter the torchrun run saves must load in one process with the
one-process run's eval loss. (test_torchrun_moe.py runs it padded, on the MoE
builtin, with expert parallelism and activation checkpointing.) A group size
the model's heads cannot split is refused before anything trains.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from twinkle.hub import resolve_dataset, resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_harness import CPU_ONLY, compare_cookbook_runs, run_refusals

COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook" / "sft" / "sequence_parallel.py"
KNOBS = {**CPU_ONLY, "EPOCHS": "1", "BATCH_SIZE": "8", "MAX_STEPS": "5", "MAX_NEW_TOKENS": "2"}


@pytest.mark.integration
def test_ulysses_over_fsdp2_matches_one_process(tmp_path):
    resolve_model("builtin://qwen3-tiny")  # built once, before several processes want it
    resolve_dataset("builtin://self-cognition")
    knobs = {**KNOBS, "MODEL_ID": "builtin://qwen3-tiny", "ULYSSES_SIZE": "1"}
    output = compare_cookbook_runs(COOKBOOK, tmp_path, knobs, {"ULYSSES_SIZE": "2"})
    assert "2 process(es), ulysses_size=2" in output, output[-2000:]


@pytest.mark.integration
def test_group_size_that_does_not_split_the_heads_is_refused():
    resolve_model("builtin://qwen3-tiny")
    message = run_refusals(["heads-split"], nproc=3)["heads-split"]
    assert message.startswith(
        "ulysses_size=3 must divide the model's attention heads (num_attention_heads=4, num_key_value_heads=2)"
    )
