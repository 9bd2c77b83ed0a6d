"""DDP and FSDP2 under a real two-process torchrun (gloo) train exactly like one process on the whole batch.

The test launches this file as the worker (``python -m torch.distributed.run
--nproc_per_node 2 test_distributed_training.py OUT``). Every rank trains a
one-process reference on the whole batch and then, per mesh, a data-parallel
model on its share (7 samples: shares of 4 and 3, in micro-batches of 2), and
writes what it saw; the test compares. LoRA and full-parameter training, the
consolidated checkpoint (loaded back in one process), resuming an FSDP run
from that checkpoint, FSDP2 with activation checkpointing, and a call that fails on one rank only are
covered.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 3
MESHES = {"ddp": {"dp_size": 2}, "fsdp": {"fsdp_size": 2}}
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory) -> dict[str, Any]:
    from twinkle.hub import resolve_model

    resolve_model(None)  # build the embedded model once, not in both workers at the same time
    out = tmp_path_factory.mktemp("torchrun")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    command += [f"--master_port={_free_port()}", __file__, str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and both workers
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-4000:]
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.integration
@pytest.mark.parametrize("training", ["lora", "full"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_data_parallel_steps_equal_one_process_steps(worker_results, mesh, training):
    for rank, results in worker_results.items():
        reference, ours = results[training]["reference"], results[training][mesh]
        for key in ("loss", "num_tokens", "grad_norm", "eval_loss", "metric"):
            assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-5), (rank, key)
        assert ours["reloaded_eval_loss"] == pytest.approx(ours["eval_loss"], rel=1e-6), rank


@pytest.mark.integration
def test_fsdp_with_activation_checkpointing_trains_like_one_process(worker_results):
    for rank, results in worker_results.items():
        reference, ours = results["lora"]["reference"], results["lora"]["fsdp_checkpointed"]
        for key in ("loss", "grad_norm", "eval_loss"):
            assert ours[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-5), (rank, key)


@pytest.mark.integration
def test_an_fsdp_run_resumes_from_its_consolidated_checkpoint(worker_results):
    for results in worker_results.values():
        assert results["resume"]["resumed"] == pytest.approx(results["resume"]["continued"], rel=1e-6)


@pytest.mark.integration
def test_a_share_that_fails_on_one_rank_fails_the_call_on_both_and_training_goes_on(worker_results):
    rank0, rank1 = worker_results[0]["one_rank_fails"], worker_results[1]["one_rank_fails"]
    # Rank 1 sent the bad sample and ran the failing loss; rank 0 raises too, with rank 1's message.
    assert "another data-parallel rank rejected its share" in rank0["input"] and "rank 1" in rank0["input"]
    assert "outside the vocabulary" in rank1["input"]
    assert "rank 1: RuntimeError: loss failed on rank 1" in rank0["loss"] and "loss failed on rank 1" in rank1["loss"]
    for seen in (rank0, rank1):  # no weight or gradient changed, and the next call trains as usual
        assert seen["unchanged"] and seen["next_step"] == pytest.approx(seen["expected_step"], rel=1e-6)


# ---------------------------------------------------------------------------- the worker (one per rank)


def _features() -> list[dict[str, Any]]:
    import torch

    from twinkle.data_format import IGNORE_INDEX, make_input_feature

    generator = torch.Generator().manual_seed(0)
    features = []
    for length in (9, 14, 11, 20, 8, 16, 12):
        ids = torch.randint(0, 5000, (length,), generator=generator).tolist()
        features.append(make_input_feature(ids, [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]))
    return features


def _model(mesh: Any, training: str, gradient_checkpointing: bool = False) -> Any:
    import torch
    from peft import LoraConfig

    from twinkle.model import TransformersModel

    torch.manual_seed(0)
    model = TransformersModel(device="cpu", device_mesh=mesh, gradient_checkpointing=gradient_checkpointing)
    if training == "lora":
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # B != 0, so A trains too
            for name, param in model.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    model.set_optimizer("AdamW", lr=1e-3)
    return model


def _train(model: Any, features: list, steps: int = STEPS) -> dict[str, list[float]]:
    seen: dict[str, list[float]] = {"loss": [], "num_tokens": [], "grad_norm": []}
    for _ in range(steps):
        output = model.forward_backward(inputs=features, micro_batch_size=2)
        seen["loss"].append(output.loss)
        seen["num_tokens"].append(output.num_tokens)
        seen["grad_norm"].append(model.clip_grad_and_step()["grad_norm"])
    return seen


def _run(mesh: Any, training: str, features: list, share: list, out: Path, checkpointing: bool = False) -> dict:
    from twinkle.model import TransformersModel

    model = _model(mesh, training, checkpointing)
    seen = _train(model, share)
    metric = model.calculate_metric()
    seen["metric"] = [metric[key] for key in ("loss", "num_supervised_tokens", "num_tokens", "accuracy", "grad_norm")]
    seen["eval_loss"] = model.forward_only(inputs=share).loss
    if mesh is not None:
        path = model.save(f"{training}-{mesh.size('fsdp')}", output_dir=out, save_optimizer=training == "lora")
        single = TransformersModel(device="cpu")  # the consolidated checkpoint, loaded the usual way
        single.load(path)
        seen["reloaded_eval_loss"] = single.forward_only(inputs=features).loss
    return seen


def _resume(mesh: Any, share: list, out: Path) -> dict[str, float]:
    """FSDP: 2 steps, save, a new model resumes and takes step 3; it must equal step 3 of the first model."""
    first = _model(mesh, "lora")
    _train(first, share, steps=2)
    path = first.save("resume", output_dir=out)
    continued = _train(first, share, steps=1)["loss"][0]
    resumed = _model(mesh, "lora")
    resumed.resume_from_checkpoint(path)
    return {"continued": continued, "resumed": _train(resumed, share, steps=1)["loss"][0]}


def _one_rank_fails(mesh: Any, share: list, rank: int) -> dict[str, Any]:
    """DDP: rank 1 sends a bad sample, then its loss raises after the forward; both ranks must raise each time."""
    import torch

    from twinkle.loss import CrossEntropyLoss

    class FailsOnRankOne(CrossEntropyLoss):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if rank == 1:
                raise RuntimeError("loss failed on rank 1")
            return super().__call__(*args, **kwargs)

    model, errors = _model(mesh, "lora"), {}
    params = model.train_state(None).params
    before = [p.detach().clone() for p in params]
    bad = [dict(share[0], input_ids=[10**9] * len(share[0]["input_ids"]))] if rank == 1 else share
    for name, inputs, loss in (("input", bad, CrossEntropyLoss()), ("loss", share, FailsOnRankOne())):
        model.set_loss(loss)
        try:
            model.forward_backward(inputs=inputs)
        except Exception as exc:  # recorded for the test to check
            errors[name] = str(exc)
    model.set_loss(CrossEntropyLoss())
    same_weights = all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    unchanged = same_weights and all(p.grad is None for p in params)
    reference = _model(mesh, "lora")
    return {
        **errors,
        "unchanged": unchanged,
        "next_step": _train(model, share, steps=1)["loss"][0],
        "expected_step": _train(reference, share, steps=1)["loss"][0],
    }


def _worker(out: Path) -> None:
    import torch

    import twinkle
    from twinkle.infra import DeviceMesh

    torch.set_num_threads(1)
    runtime = twinkle.initialize(seed=0)
    features = _features()
    results: dict[str, Any] = {}
    for training in ("lora", "full"):
        results[training] = {"reference": _run(None, training, features, features, out)}
        for name, sizes in MESHES.items():
            mesh = DeviceMesh.from_sizes(**sizes)
            share = features[mesh.get_slice(len(features), runtime.rank)]
            results[training][name] = _run(mesh, training, features, share, out)
    fsdp = DeviceMesh.from_sizes(**MESHES["fsdp"])
    fsdp_share = features[fsdp.get_slice(len(features), runtime.rank)]
    results["lora"]["fsdp_checkpointed"] = _run(fsdp, "lora", features, fsdp_share, out, checkpointing=True)
    results["resume"] = _resume(fsdp, features[fsdp.get_slice(len(features), runtime.rank)], out)
    ddp = DeviceMesh.from_sizes(**MESHES["ddp"])
    results["one_rank_fails"] = _one_rank_fails(ddp, features[ddp.get_slice(len(features), runtime.rank)], runtime.rank)
    (out / f"rank{runtime.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
