"""The MoE builtin under ``torchrun --nproc_per_node 2``: FSDP2 and expert parallelism train exactly like one process.

Each cookbook, shrunk through its knobs, runs in one process and then over two:

- ``moe.py`` over FSDP2, with LoRA on everything linear (the fused experts included);
- ``expert_parallel.py`` with each process holding half of every layer's experts (tokens sent to them
  by all-to-all) and training their LoRA pairs, over FSDP2, together with Ulysses sequence parallelism,
  activation checkpointing and padded batches: the features compose.

Loss curves agree within 1e-4 over five steps, and the adapters the torchrun runs save (gathered from
FSDP2's shards, and the experts' pairs from the expert-parallel ranks) load in one process with the
one-process runs' eval losses. Meshes the model cannot use are refused with errors that name the sizes,
before anything trains.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from twinkle.hub import resolve_dataset, resolve_model

sys.path.insert(0, str(Path(__file__).parent))
from torchrun_harness import CPU_ONLY, compare_cookbook_runs, run_refusals

COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook" / "sft"
KNOBS = {
    **CPU_ONLY,
    "MODEL_ID": "builtin://qwen3-moe-tiny",
    "EPOCHS": "1",
    "BATCH_SIZE": "8",
    "MAX_STEPS": "5",
    "MAX_NEW_TOKENS": "2",
}


@pytest.fixture(scope="module", autouse=True)
def _embedded_defaults() -> None:
    for model_id in ("builtin://qwen3-moe-tiny", "builtin://qwen3-tiny"):  # built once, before several processes
        resolve_model(model_id)
    resolve_dataset("builtin://self-cognition")


@pytest.mark.integration
def test_fsdp2_moe_lora_matches_one_process(tmp_path):
    output = compare_cookbook_runs(COOKBOOK / "moe.py", tmp_path, KNOBS, {})
    assert "2 process(es), fsdp_size=2)" in output, output[-2000:]


@pytest.mark.integration
def test_expert_parallel_with_sequence_parallel_matches_one_process(tmp_path):
    knobs = {**KNOBS, "PADDING_FREE": "0", "GRADIENT_CHECKPOINTING": "1", "EP_SIZE": "1"}
    split = {"EP_SIZE": "2", "ULYSSES_SIZE": "2"}
    output = compare_cookbook_runs(COOKBOOK / "expert_parallel.py", tmp_path, knobs, split)
    assert "2 process(es), fsdp_size=2, ep_size=2, ulysses_size=2)" in output, output[-2000:]


@pytest.mark.integration
def test_meshes_the_model_cannot_use_are_refused():
    cases = ["dense-ep", "ddp-ep", "experts-split", "heads-split", "megatron-heads", "megatron-layers"]
    three = run_refusals([*cases, "megatron-experts"], nproc=3)  # one launch: 3 divides none of the model's sizes
    assert three["dense-ep"] == "ep_size=3: Qwen3ForCausalLM has no fused MoE experts to spread over the ranks"
    assert three["ddp-ep"].startswith("expert parallelism (ep_size=3) shards the rest of the model with FSDP2")
    assert three["experts-split"] == (
        "ep_size=3 must divide the number of experts per MoE layer (8, in model.layers.0.mlp.experts)"
    )
    assert three["heads-split"].startswith(
        "ulysses_size=3 must divide the model's attention heads (num_attention_heads=4, num_key_value_heads=2)"
    )
    assert three["megatron-heads"] == (
        "tp_size=3 must divide the attention heads (num_attention_heads=4) and the query groups (num_key_value_heads=2)"
    )
    assert three["megatron-layers"] == "pp_size=3 must divide the decoder layers (num_hidden_layers=4)"
    assert three["megatron-experts"] == "ep_size=3 must divide the experts of each MoE layer (num_experts=8)"
