"""Router replay on the MoE builtin: the trainer routes each token to the experts the sampler chose.

``TorchSampler(record_routing=True)`` puts every token's experts into each completion's
``new_input_feature``; a model trained on those features replays them, in forward and in the backward's
recomputation. Checked: the trainer's log-probs equal the sampler's (1e-5) with replay, and the mismatch
without it is printed; when the trainer's router has drifted (its weights perturbed, as after an update
the sampler has not seen yet), replay still sends every recorded token to the sampler's experts, while
the router's own probabilities weight them; gradients are those of the plain forward with activation
checkpointing too, and with Ulysses sequence parallelism over FSDP2 under torchrun (each rank replays
its share of the tokens); and records that do not fit the model are refused by name. Float64 with the eager
expert loop (torch's grouped matmul has no float64), so a near tie cannot flip between two correct runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler

sys.path.insert(0, str(Path(__file__).parent))
from router_replay_split import MOE, OPTIONS, drifted, sampled_features
from torchrun_harness import CPU_ONLY, TIMEOUT_S, free_port

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def sampled() -> tuple[list[dict[str, Any]], list[list[float]]]:
    return sampled_features()


def _completion_logps(model: TransformersModel, features: list[dict[str, Any]], sampled: list[list[float]]) -> Any:
    output = model.forward_only(inputs=features)
    return [logps[-len(ours) :] for logps, ours in zip(output.logps, sampled, strict=True)]


def _chosen_experts(model: TransformersModel) -> tuple[list[torch.Tensor], list[Any]]:
    """What each MoE layer's experts are called with (their ``top_k_index``), captured from outside."""
    seen: list[torch.Tensor] = []
    experts = [module for name, module in model.model.named_modules() if name.endswith("mlp.experts")]
    hooks = [module.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone())) for module in experts]
    return seen, hooks


def test_trainer_logps_equal_the_samplers_with_replay(sampled):
    features, logprobs = sampled
    assert all(len(f["routed_experts"]) == len(f["input_ids"]) for f in features)
    model = TransformersModel(MOE, device="cpu", **OPTIONS)
    replayed = _completion_logps(model, features, logprobs)
    free = _completion_logps(model, [{k: v for k, v in f.items() if k != "routed_experts"} for f in features], logprobs)
    expected = [torch.tensor(ours, dtype=torch.float64) for ours in logprobs]
    with_replay = max(float((a.double() - b).abs().max()) for a, b in zip(replayed, expected, strict=True))
    without = max(float((a.double() - b).abs().max()) for a, b in zip(free, expected, strict=True))
    print(f"max |sampler - trainer| log-prob: {with_replay:.1e} with router replay, {without:.1e} without")
    assert with_replay <= 1e-5


def test_a_drifted_router_still_sends_tokens_to_the_recorded_experts(sampled):
    features, _ = sampled
    model = drifted(TransformersModel(MOE, device="cpu", **OPTIONS))
    seen, hooks = _chosen_experts(model)
    try:
        model.forward_only(inputs=features[:1])
        replayed = [chosen.clone() for chosen in seen]
        seen.clear()
        model.forward_only(inputs=[{k: v for k, v in features[0].items() if k != "routed_experts"}])
    finally:
        for hook in hooks:
            hook.remove()
    recorded = torch.tensor(features[0]["routed_experts"])  # [T, layers, top_k]; the last token is free
    for layer, ours in enumerate(replayed):
        assert torch.equal(ours[:-1], recorded[:-1, layer]), layer
    assert any(not torch.equal(d[:-1], recorded[:-1, layer]) for layer, d in enumerate(seen))  # drift is real


def test_replayed_gradients_are_the_same_with_activation_checkpointing(sampled):
    features, _ = sampled
    grads = []
    for checkpointing in (False, True):  # drifted: a recomputation routed freely would differ from its forward
        model = drifted(TransformersModel(MOE, device="cpu", gradient_checkpointing=checkpointing, **OPTIONS))
        model.add_adapter_to_model("default", {"r": 4, "target_modules": ["q_proj", "v_proj"]}, seed=0)
        model.forward_backward(inputs=features)
        grads.append([param.grad.clone() for param in model.train_state(None).params])
    for plain, checkpointed in zip(*grads, strict=True):
        assert torch.allclose(plain, checkpointed, atol=1e-12, rtol=1e-10)


def test_records_that_do_not_fit_the_model_are_refused(sampled):
    features, _ = sampled
    feature = features[0]
    moe = TransformersModel(MOE, device="cpu", **OPTIONS)
    two_layers = {**feature, "routed_experts": [layers[:2] for layers in feature["routed_experts"]]}
    with pytest.raises(InvalidInputError, match=r"records 2 layer\(s\) x top-2; the model has 4 MoE layer\(s\)"):
        moe.forward_only(inputs=[two_layers])
    beyond = {**feature, "routed_experts": [[[0, 8]] * 4 for _ in feature["input_ids"]]}
    with pytest.raises(InvalidInputError, match="holds expert id 8; the model has 8"):
        moe.forward_only(inputs=[beyond])
    short = {**feature, "routed_experts": feature["routed_experts"][:-1]}
    with pytest.raises(InvalidInputError, match="must hold one entry per token"):
        moe.forward_only(inputs=[short])
    with pytest.raises(InvalidInputError, match="no softmax top-k MoE router"):
        TransformersModel(device="cpu").forward_only(inputs=[feature])
    with pytest.raises(ConfigurationError, match="record_routing: Qwen3ForCausalLM has no softmax top-k MoE router"):
        TorchSampler(device="cpu", record_routing=True)


def test_replay_under_ulysses_over_fsdp2_equals_one_process():
    script = Path(__file__).parent / "router_replay_split.py"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1"]
    completed = subprocess.run(
        [*launcher, f"--master_port={free_port()}", str(script)],
        env={**os.environ, **CPU_ONLY},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))[7:])
    split, alone = result["split"], result["alone"]
    print("losses, split over 2 ranks:", split["losses"], "alone:", alone["losses"])
    assert split["losses"] == pytest.approx(alone["losses"], abs=1e-8)  # 3 steps: the gradients agree too
    for ours, theirs in zip(split["logps"], alone["logps"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-8)
