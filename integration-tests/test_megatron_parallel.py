"""MegatronModel under torchrun (2 and 4 processes): tensor, pipeline, expert and data parallelism equal one process.

``megatron_training.py`` trains every weight of ``builtin://qwen3-tiny``, then a LoRA adapter on every
projection, for 5 steps with ``tp_size=2`` (each rank holding half of every attention and MLP projection,
of the vocabulary and of the adapter's pairs), with ``pp_size=2`` (each rank two of the four decoder
layers and their adapter pairs, the tied embeddings on both) and with ``dp_size=2``; and the same for
``builtin://qwen3-moe-tiny`` with ``tp_size=2`` (half of every expert, and of the adapter's expert pairs)
and with ``ep_size=2`` over ``dp_size=2`` (four of the eight experts of every layer each, and their pairs,
tokens exchanged all-to-all); then, in four processes, expert parallelism with ``tp_size=2`` (each
expert-parallel group exchanges one tensor-parallel rank's parts of its experts) and with ``pp_size=2`` (one
stage's layers). This process runs the same steps alone. In float64 (where only summation order differs):
the losses and gradient norms agree to 1e-8 (MoE: 1e-6, see ``MOE_TOL``), clipping binds, resuming from the
step-2 checkpoint repeats steps 3-5, and the final checkpoints (shards gathered whole) load in plain
transformers (+ PEFT for the adapter) with the one-process checkpoint's logits. Two tenants' adapters trained
together in shared passes (``MultiLoraMegatronModel``, the MoE builtin) at ``tp_size=2``, and at ``ep_size=2``
over ``dp_size=2`` (each token's adapter travelling with it to its expert's rank), get the losses and gradient
norms they get in one process (where test_megatron_multi_lora.py shows each equals training alone). The
router's load-balancing loss at ``tp_size=2`` and at ``pp_size=2`` trains as in one process. At ``pp_size=2``
the first stage runs the next micro-batch before this one's backward (the "1f1b" schedule) and trains exactly
as with one micro-batch at a time. Log-probs from vocabulary slices equal the whole softmax. The tenants' and
the router loss's parallel runs recompute every decoder layer in backward (``gradient_checkpointing``), so
recomputation is shown to repeat each layer's collectives (tensor parallelism, the experts' all-to-all, the
stages' router logits) as its forward ran them; their one-process references keep their activations.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

pytest.importorskip("megatron.core", reason="needs twinkle-model[megatron]")
sys.path.insert(0, str(Path(__file__).parent))
from conversations import encoded_conversations
from megatron_training import (
    KINDS,
    LAYOUTS,
    MODEL,
    MOE_MODEL,
    RESUMED,
    ROUTER_LAYOUTS,
    SCHEDULE_LAYOUTS,
    TENANT_LAYOUTS,
    label,
    make_model,
    run,
    train_router_loss,
    train_schedule,
    train_tenants,
    world_of,
)
from resumed_training import steps
from torchrun_harness import CPU_ONLY, TIMEOUT_S, free_port

from twinkle.hub import resolve_model

pytestmark = [pytest.mark.integration]
TOL = {"abs": 1e-8}  # float64: summation order moves these by ~1e-12
# MoE: the router's softmax runs in float32 (as transformers'), where float64 round-off can flip an ulp: ~1e-8.
MOE_TOL = {"abs": 1e-6}


def _torchrun(layouts: list[str], output: Path, processes: int = 2) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}"]
    command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
    command += [str(Path(__file__).parent / "megatron_training.py")]
    completed = subprocess.run(
        [*command, ",".join(layouts), str(output)],
        env={**os.environ, **CPU_ONLY},
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT_S,  # many layouts in one launch, to import megatron-core once
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
    return dict(json.loads(line.removeprefix("RESULT ")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    for model_id in (MODEL, MOE_MODEL):
        resolve_model(model_id)  # built once, before several processes
    output = tmp_path_factory.mktemp("megatron")
    # One launch per world size: megatron-core's import is most of a run's time.
    pairs = [layout for layout in LAYOUTS if world_of(layout) == 2]
    results = _torchrun([*pairs, *TENANT_LAYOUTS, *ROUTER_LAYOUTS, *SCHEDULE_LAYOUTS, "vocab-parallel"], output)
    results |= _torchrun([layout for layout in LAYOUTS if world_of(layout) == 4], output, processes=4)
    for layout in LAYOUTS:
        model_id, _, targets = LAYOUTS[layout]
        for kind in KINDS:
            name = _alone(layout, kind)
            if name not in results:  # each one-process run once (full-parameter runs ignore the targets)
                results[name] = run(None, kind == "lora", output / name, model_id, targets, resume=False)
    return results


def _alone(layout: str, kind: str) -> str:
    """The name of the one-process run ``layout``'s ``kind`` of run is compared with."""
    model_id, _, targets = LAYOUTS[layout]
    adapter = "" if kind == "full" else f"-{label(targets)}"
    return f"alone-{model_id.rpartition('/')[2]}-{kind}{adapter}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_training_equals_one_process(runs, layout, kind):
    split, alone = runs[layout][kind], runs[_alone(layout, kind)]
    print(f"{layout}_size=2, {kind}: losses {split['losses']}, one process {alone['losses']}")
    tol = MOE_TOL if layout.endswith("-moe") else TOL
    assert split["losses"] == pytest.approx(alone["losses"], **tol)
    assert split["norms"] == pytest.approx(alone["norms"], **tol)
    assert sum(norm > 1.0 for norm in split["norms"]) >= 4  # clipping to 1.0 binds: the norm counts every shard once
    if layout in RESUMED:
        assert split["resumed"] == pytest.approx(split["losses"][2:], abs=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "dp"])
def test_model_parallel_checkpoints_load_in_plain_transformers(runs, layout, kind):
    moe = layout.endswith("-moe")
    split = _plain_logits(runs[layout][kind]["final"], kind, moe)
    alone = _plain_logits(runs[_alone(layout, kind)]["final"], kind, moe)
    for split_TV, alone_TV in zip(split, alone, strict=True):
        atol = 1e-5 if moe else 1e-8  # MoE: see MOE_TOL; ~1e-6 in logits after 5 steps
        assert torch.allclose(split_TV, alone_TV, atol=atol, rtol=0), float((split_TV - alone_TV).abs().max())
    assert not torch.allclose(split[0], _plain_logits(None, kind, moe)[0], atol=1e-3)  # the steps were saved


@functools.cache
def _plain_logits(checkpoint: str | None, kind: str, moe: bool) -> list[torch.Tensor]:
    """Plain transformers' (+ PEFT's) logits of the conversations from a saved checkpoint (``None``: untrained);
    one-process checkpoints serve several layouts, so each is loaded once."""
    plain = resolve_model(MOE_MODEL if moe else MODEL)
    options: dict[str, Any] = {"dtype": torch.float64, **({"experts_implementation": "eager"} if moe else {})}
    if checkpoint is None:
        model = AutoModelForCausalLM.from_pretrained(plain, **options)
    elif kind == "lora":
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(plain, **options), checkpoint)
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, **options)
    with torch.no_grad():
        return [model.eval()(torch.tensor([f["input_ids"]])).logits[0] for f in encoded_conversations(MODEL)]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_pipeline_parallel_checkpoint_resumes_in_one_process(runs, kind):
    """The PP=2 step-2 checkpoint (each stage's layers and optimizer state, joined) resumes here, unsplit."""
    model = make_model(None, kind == "lora", MODEL, LAYOUTS["pp"][2])
    model.resume_from_checkpoint(Path(runs["pp"][kind]["final"]).parent / "step-2")
    losses, _ = steps(model, encoded_conversations(MODEL), 3)
    assert losses == pytest.approx(runs["pp"][kind]["losses"][2:], **TOL)


@pytest.fixture(scope="module")
def tenants_alone() -> dict[str, dict[str, list[float]]]:
    return train_tenants(None)


@pytest.mark.parametrize("layout", list(TENANT_LAYOUTS))
def test_tenants_in_shared_passes_equal_one_process(runs, tenants_alone, layout):
    for name, record in runs[layout].items():
        alone = tenants_alone[name]
        print(f"tenant {name}: {layout} losses {record['losses']}, one process {alone['losses']}")
        assert record["losses"] == pytest.approx(alone["losses"], **MOE_TOL)
        assert record["norms"] == pytest.approx(alone["norms"], **MOE_TOL)


@pytest.fixture(scope="module")
def router_loss_alone() -> dict[str, Any]:
    return train_router_loss(None)


@pytest.mark.parametrize("layout", list(ROUTER_LAYOUTS))
def test_the_routers_loss_over_split_layers_equals_one_process(runs, router_loss_alone, layout):
    """Each tensor-parallel rank computes the load-balancing loss whole, its gradient counted once; each pipeline
    stage computes it from every stage's routers, and back-propagates its own."""
    split, alone = runs[layout], router_loss_alone
    print(f"router loss, {layout}: {split}, one process {alone}")
    assert split["aux"] == pytest.approx(alone["aux"], **MOE_TOL) and split["aux"] > 0.5
    assert split["losses"] == pytest.approx(alone["losses"], **MOE_TOL)
    assert split["norms"] == pytest.approx(alone["norms"], **MOE_TOL)


def test_the_1f1b_schedule_runs_the_next_micro_batch_before_this_ones_backward_and_trains_as_one_process(runs):
    """At pp_size=2 the first stage runs its layers on micro-batch i+1 before micro-batch i's backward ("1f1b"),
    or on one micro-batch at a time ("sequential"); a tenant whose loss failed in an earlier micro-batch still
    sends its later rows through every stage (their loss skipped), so the stages keep exchanging the same
    tensors. The other tenant trains exactly alike under both schedules, and as in one process."""
    alone = train_schedule(None, "1f1b")
    overlapped, sequential = runs["schedule-1f1b"], runs["schedule-sequential"]
    # passes bad, bad (its loss failed: no backward), x, x
    assert alone["order"] == sequential["order"] == "FFFBFB"
    assert overlapped["order"] == "FFFFBB"
    assert overlapped["losses"] == sequential["losses"] and overlapped["norms"] == sequential["norms"]
    assert overlapped["losses"] == pytest.approx(alone["losses"], **TOL)
    assert overlapped["norms"] == pytest.approx(alone["norms"], **TOL)
    assert overlapped["errors"] == sequential["errors"] == ["tenant loss exploded"] * 2


def test_log_probs_from_vocabulary_slices_equal_the_whole_softmax(runs):
    """Under tensor parallelism each rank computes the targets' log-probs from its slice of the logits (the
    ranks exchange per-token maxima, sums and argmaxes, never the logits): equal to ``log_softmax`` of the
    whole in value and gradient (float64), argmax hits included."""
    errors = runs["vocab-parallel"]
    assert errors["logps"] < 1e-12 and errors["grad"] < 1e-12
    assert errors["correct"] == errors["expected_correct"] == [False, True, False, False, True, False]
