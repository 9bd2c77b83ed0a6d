"""``MegatronModel`` in one process (tensor-parallel size 1) against plain transformers on the same weights.

The logits, loss and every gradient (mapped back to transformers' names) equal the transformers model's
(1e-5), for the dense and the MoE builtin; so do a LoRA adapter's loss and gradients against PEFT's from the
same saved adapter, and an adapter trained here loads in plain PEFT with the trainer's logits; a trained model saves a
directory plain transformers loads with the trainer's logits; resuming from a checkpoint repeats the
next steps; and what the back-end cannot do yet is refused by name. Both sides run in float64: transformers
still computes Qwen3's RMSNorm in float32, which bounds the agreement at ~1e-7 on any CPU, where two float32
models would differ by whatever summation order each CPU's kernels choose.
The tensor-parallel and data-parallel runs are in integration-tests/test_megatron_parallel.py.
"""

from __future__ import annotations

import gc
import inspect
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.model import TransformersModel

megatron = pytest.importorskip("twinkle.model.megatron", reason="needs twinkle-model[megatron]")
from twinkle.model.megatron.conversion import to_transformers  # noqa: E402

MODEL = "builtin://qwen3-tiny"
MOE_MODEL = "builtin://qwen3-moe-tiny"
DTYPE = torch.float64  # see the module docstring
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def model() -> Any:
    return megatron.MegatronModel(MODEL, device="cpu", dtype=DTYPE)


def _plain(model_id: str = MODEL) -> Any:
    eager = {"experts_implementation": "eager"} if model_id == MOE_MODEL else {}  # grouped matmul: no float64
    return AutoModelForCausalLM.from_pretrained(resolve_model(model_id), dtype=DTYPE, **eager)


@pytest.mark.parametrize("model_id", [MODEL, MOE_MODEL], ids=["dense", "moe"])
def test_logits_loss_and_gradients_equal_transformers(model, model_id, sft_features):
    if model_id == MOE_MODEL:  # megatron's attention and our MoE layers (router, experts) in every layer
        model = megatron.MegatronModel(MOE_MODEL, device="cpu", dtype=DTYPE)
    features = sft_features[:4]
    ours = model.forward_only(features, return_logits=True).logits
    plain = _plain(model_id)
    total, count = torch.zeros((), dtype=DTYPE), 0
    for feature, logits in zip(features, ours, strict=True):
        theirs = plain(torch.tensor([feature["input_ids"]])).logits[0]
        assert torch.allclose(logits, theirs.detach(), **TOL), float((logits - theirs).abs().max())
        labels = torch.tensor(feature["labels"])
        total = total + F.cross_entropy(theirs[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels[1:] != IGNORE_INDEX).sum())
    (total / count).backward()
    output = model.forward_backward(features)
    assert output.loss == pytest.approx(float(total / count), rel=1e-5)
    grads = to_transformers({name: p.grad for name, p in model.model.gpt.named_parameters()}, plain.config)
    expected = dict(plain.named_parameters())
    for name, grad in grads.items():
        reference = expected[name].grad
        scale = float(reference.abs().max())
        assert torch.allclose(grad, reference, atol=1e-5 * max(scale, 1.0), rtol=1e-4), name
    model.zero_grad()


def test_a_trained_model_saves_what_transformers_loads_and_resumes(sft_features, tmp_path: Path):
    model = megatron.MegatronModel(MODEL, device="cpu", dtype=DTYPE)
    model.set_optimizer("AdamW", lr=1e-3)
    batch = sft_features[:4]
    for _ in range(2):
        model.forward_backward(batch)
        model.clip_grad_and_step()
    checkpoint = model.save("step-2", output_dir=tmp_path)
    after = []
    for _ in range(2):
        after.append(model.forward_backward(batch).loss)
        model.clip_grad_and_step()
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=DTYPE)
    resumed = megatron.MegatronModel(MODEL, device="cpu", dtype=DTYPE)
    resumed.set_optimizer("AdamW", lr=1e-3)
    resumed.resume_from_checkpoint(checkpoint)
    repeated = []
    for _ in range(2):
        repeated.append(resumed.forward_backward(batch).loss)
        resumed.clip_grad_and_step()
    assert repeated == pytest.approx(after, abs=1e-6)
    ours = resumed.forward_only(batch[:1], return_logits=True).logits[0]
    model_logits = model.forward_only(batch[:1], return_logits=True).logits[0]
    assert torch.allclose(ours, model_logits, atol=1e-5)  # the same weights after the same steps
    with torch.no_grad():
        saved = reloaded(torch.tensor([batch[0]["input_ids"]])).logits[0]
    step_two = megatron.MegatronModel(MODEL, device="cpu", dtype=DTYPE)
    step_two.load(checkpoint)
    assert torch.allclose(step_two.forward_only(batch[:1], return_logits=True).logits[0], saved, **TOL)


@pytest.mark.parametrize(
    ("model_id", "targets"),
    [(MODEL, "all-linear"), (MOE_MODEL, "all-linear"), (MODEL, ["q_proj", "v_proj", "lm_head"])],
    ids=["dense", "moe", "output-layer"],
)
def test_lora_equals_peft_and_loads_in_peft(model_id, targets, sft_features, tmp_path: Path):
    """On the MoE builtin PEFT's "all-linear" adapts the attention, the fused experts and the router; ``lm_head``
    adapts the (tied) output layer."""
    features = sft_features[:4]
    start = get_peft_model(_plain(model_id), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in start.named_parameters():
            if "lora_" in name:  # B too, so every gradient is non-trivial
                param.copy_(torch.randn(param.shape, generator=generator, dtype=DTYPE) * 0.05)
    start.save_pretrained(tmp_path / "start", save_embedding_layers=False)  # the adapter alone, tied lm_head too
    model = megatron.MegatronModel(model_id, device="cpu", dtype=DTYPE)
    model.add_adapter_to_model("default", str(tmp_path / "start"))
    output = model.forward_backward(features)
    peft = PeftModel.from_pretrained(_plain(model_id), tmp_path / "start", is_trainable=True)
    total, count = torch.zeros((), dtype=DTYPE), 0
    for feature in features:
        labels = torch.tensor(feature["labels"])
        logits = peft(torch.tensor([feature["input_ids"]])).logits[0]
        total = total + F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels[1:] != IGNORE_INDEX).sum())
    (total / count).backward()
    assert output.loss == pytest.approx(float(total / count), rel=1e-5)
    expected = {name.replace(".default.", "."): p.grad for name, p in peft.named_parameters() if p.grad is not None}
    ours = model.adapter_state_dict(model.train_state("default"))
    assert set(ours) == set(expected)
    for key, param in ours.items():
        scale = float(expected[key].abs().max())
        assert torch.allclose(param.grad, expected[key], atol=1e-5 * max(scale, 1.0), rtol=1e-4), key
    model.set_optimizer("AdamW", lr=1e-2)
    model.clip_grad_and_step()
    saved = model.save("trained", output_dir=tmp_path, save_optimizer=False)
    reloaded = PeftModel.from_pretrained(_plain(model_id), saved).eval()
    with torch.no_grad():
        theirs = reloaded(torch.tensor([features[0]["input_ids"]])).logits[0]
    ours_logits = model.forward_only(features[:1], return_logits=True).logits[0]
    assert torch.allclose(ours_logits, theirs, **TOL)


def test_the_routers_load_balancing_loss_equals_the_transformers_back_ends(sft_features):
    """``output_router_logits``: the loss adds ``coef × aux`` and every weight's gradient follows it, as on
    ``TransformersModel`` (whose router loss test_router_aux_loss.py checks against transformers' own)."""
    features = sft_features[:3]
    router = {"output_router_logits": True, "router_aux_loss_coef": 0.5}  # large: a missing aux shows at once
    ours = megatron.MegatronModel(MOE_MODEL, device="cpu", dtype=DTYPE, **router)
    output = ours.forward_backward(features)
    theirs = TransformersModel(MOE_MODEL, device="cpu", dtype=DTYPE, experts_implementation="eager", **router)
    expected = theirs.forward_backward(features)
    assert output.loss == pytest.approx(expected.loss, rel=1e-5)  # see the module docstring: float32 RMSNorm
    aux = ours.calculate_metric()["loss/router_aux_loss"]
    assert aux == pytest.approx(theirs.calculate_metric()["loss/router_aux_loss"], rel=1e-5) and aux > 0.5
    plain = dict(theirs.model.named_parameters())
    grads = to_transformers({name: p.grad for name, p in ours.model.gpt.named_parameters()}, ours.model.config)
    for name, grad in grads.items():
        scale = float(plain[name].grad.abs().max())
        assert torch.allclose(grad, plain[name].grad, atol=1e-5 * max(scale, 1.0), rtol=1e-4), name
    assert not torch.allclose(grads["model.layers.0.mlp.gate.weight"], _without_aux(features), atol=1e-3)


def _without_aux(features: list[dict[str, Any]]) -> torch.Tensor:
    """The first router's gradient without the load-balancing loss."""
    model = megatron.MegatronModel(MOE_MODEL, device="cpu", dtype=DTYPE)
    model.forward_backward(features)
    return dict(model.model.gpt.named_parameters())["decoder.layers.0.mlp.router"].grad


def test_what_the_back_end_cannot_do_yet_is_refused(model, tmp_path: Path):
    with pytest.raises(ConfigurationError, match="match no projection of the decoder layers"):
        model.add_adapter_to_model("nothing", {"r": 4, "target_modules": ["embed_tokens"]})
    # PEFT saves the output layer's base weight beside an lm_head adapter unless told not to: named, not loaded.
    saved = get_peft_model(_plain(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    saved.save_pretrained(tmp_path / "with-base", save_embedding_layers=True)
    with pytest.raises(ConfigurationError, match=r"'base_model\.model\.lm_head\.base_layer\.weight' is a base weight"):
        model.add_adapter_to_model("with-base", str(tmp_path / "with-base"))
    assert model.adapter_names == []
    model.add_adapter_to_model("head", {"r": 4, "target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(ConfigurationError, match="adapts lm_head, whose weight is tied to the input embeddings"):
        list(model.merged_weights("head"))  # merged, it would change the embeddings too
    with pytest.raises(ConfigurationError, match="converts qwen3, qwen3_moe models; 'llama' is not one"):
        megatron.MegatronModel("builtin://llama-tiny", device="cpu")
    with pytest.raises(ConfigurationError, match=r"does not take \['kernels'\]"):
        megatron.MegatronModel(MODEL, device="cpu", dtype=DTYPE, kernels=True)
    schedules = r"pipeline_schedule must be one of \['1f1b', 'sequential'\], got 'gpipe'"
    with pytest.raises(ConfigurationError, match=schedules):
        megatron.MegatronModel(MODEL, device="cpu", dtype=DTYPE, pipeline_schedule="gpipe")


@pytest.mark.parametrize(
    ("model_id", "policy", "lora"),
    [(MODEL, True, True), (MODEL, 2, False), (MOE_MODEL, True, False)],
    ids=["dense-lora-every-layer", "dense-every-2nd", "moe-router-loss"],
)
def test_activation_checkpointing_recomputes_layers_with_the_same_gradients(model_id, policy, lora, sft_features):
    """``gradient_checkpointing``: the chosen layers run again in backward (their attention is called twice),
    and the loss and every gradient are the ones without it. Rows are packed (``padding_free``), so a layer
    recomputed without its forward's position ids (which restart in each packed sequence) would differ."""
    router = {"output_router_logits": True, "router_aux_loss_coef": 0.5} if model_id == MOE_MODEL else {}
    runs = []
    for checkpointing in (False, policy):
        model = megatron.MegatronModel(
            model_id, device="cpu", dtype=DTYPE, gradient_checkpointing=checkpointing, **router
        )
        if lora:
            model.add_adapter_to_model("default", {"r": 4, "target_modules": "all-linear"}, seed=0)
        model.set_processor("InputProcessor", padding_free=True)
        calls: list[str] = []
        for layer in model.model.gpt.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(partial(_count_call, calls))
        loss = model.forward_backward(sft_features[:4]).loss
        grads = {name: p.grad for name, p in model.model.named_parameters() if p.grad is not None}
        runs.append((loss, grads, len(calls)))
    (loss, grads, plain_calls), (recomputed_loss, recomputed_grads, recomputed_calls) = runs
    layers = model.model.config.num_hidden_layers
    assert plain_calls == layers
    assert recomputed_calls == layers + len(range(0, layers, 1 if policy is True else policy))
    assert recomputed_loss == pytest.approx(loss, abs=1e-12)
    assert grads.keys() == recomputed_grads.keys() and grads
    for name, grad in grads.items():  # the same float64 operations in the same order
        torch.testing.assert_close(recomputed_grads[name], grad, atol=1e-12, rtol=0, msg=name)


def _autocast_device(decorated: Any) -> str:
    """The device whose autocast a ``torch.amp.custom_fwd`` / ``custom_bwd`` function records or restores."""
    return inspect.getclosurevars(decorated).nonlocals["device_type"]


def _count_call(calls: list[str], module: Any, *_: Any) -> None:
    calls.append(type(module).__name__)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_mixed_precision_on_the_cpu_follows_the_float32_curve(lora, sft_features):
    """``mixed_precision="bf16"`` on a CPU: megatron's linear layers restore CPU autocast in backward (through
    ``MegatronAutocastPatch``; they do so for CUDA only), so the step runs, close to float32's."""
    from megatron.core.tensor_parallel import layers

    from twinkle.patch import MegatronAutocastPatch, applied_patches, apply_patch, remove_patch

    curves = {}
    for precision in ("no", "bf16"):
        model = megatron.MegatronModel(MODEL, device="cpu", dtype=torch.float32, mixed_precision=precision)
        if lora:
            model.add_adapter_to_model("default", {"r": 4, "target_modules": "all-linear"}, seed=0)
        model.set_optimizer("AdamW", lr=1e-2 if lora else 1e-3)
        curves[precision] = []
        for step in range(3):
            loss = model.forward_backward(sft_features[4 * step : 4 * step + 4]).loss
            curves[precision].append((loss, model.clip_grad_and_step()["grad_norm"]))
    assert applied_patches(model.model) == ["MegatronAutocastPatch"]
    for (loss, norm), (exact_loss, exact_norm) in zip(curves["bf16"], curves["no"], strict=True):
        assert loss == pytest.approx(exact_loss, rel=1e-2) and norm == pytest.approx(exact_norm, rel=5e-2)
    functions = (layers.LinearWithFrozenWeight, layers.LinearWithGradAccumulationAndAsyncCommunication)
    assert {_autocast_device(f.forward) for f in functions} | {_autocast_device(f.backward) for f in functions} == {
        "cpu"
    }
    gc.collect()  # models of earlier tests release the patch as they go
    remove_patch(model.model, "MegatronAutocastPatch")  # the last holder: megatron's own decorators again (CUDA's)
    assert {_autocast_device(f.forward) for f in functions} | {_autocast_device(f.backward) for f in functions} == {
        "cuda"
    }
    with pytest.raises(ConfigurationError, match="has none"):
        apply_patch(torch.nn.Linear(2, 2), MegatronAutocastPatch())


def test_a_seeded_adapter_is_the_same_in_any_dtype():
    """A seed draws the adapter's initial ``A`` on the CPU in float32 (experts' pairs too), so float32 and float64
    models, and a GPU's, start from the same adapter and their runs can be compared step by step."""
    adapters = []
    for dtype in (torch.float32, torch.float64):
        model = megatron.MegatronModel(MOE_MODEL, device="cpu", dtype=dtype)
        model.add_adapter_to_model("default", {"r": 4, "target_modules": "all-linear"}, seed=3)
        adapters.append(model.adapter_state_dict(model.train_state("default")))
    assert adapters[0].keys() == adapters[1].keys() and any("experts" in key for key in adapters[0])
    for key, value in adapters[0].items():
        assert value.dtype == torch.float32 and torch.equal(value.double(), adapters[1][key]), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model_id", [MODEL, MOE_MODEL], ids=["dense", "moe"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize(
    ("dtype", "precision", "loss_tolerance", "norm_tolerance"),
    [(torch.float32, "no", 1e-4, 1e-3), (torch.bfloat16, "no", 5e-2, 0.25), (torch.float32, "bf16", 5e-2, 0.25)],
    ids=["fp32", "bf16", "autocast-bf16"],
)
def test_on_cuda_training_follows_the_cpu_curve(
    model_id, lora, dtype, precision, loss_tolerance, norm_tolerance, sft_features
):
    """Five steps on the GPU against the same steps on the CPU in float64 (the same seeded adapter on both):
    the same losses and gradient norms, within what the GPU's precision allows (bfloat16 weights, or float32
    weights under bfloat16 autocast). In bfloat16 the runs drift apart step by step (measured on CPU: up to
    2% in loss and 16% in a MoE LoRA's norm by the fifth)."""
    curves = {}
    for device, run_dtype, mixed_precision in (("cpu", DTYPE, "no"), ("cuda", dtype, precision)):
        model = megatron.MegatronModel(model_id, device=device, dtype=run_dtype, mixed_precision=mixed_precision)
        if lora:
            model.add_adapter_to_model("default", {"r": 4, "target_modules": "all-linear"}, seed=0)
        model.set_optimizer("AdamW", lr=1e-2 if lora else 1e-3)
        curve = []
        for step in range(5):
            loss = model.forward_backward(sft_features[3 * step : 3 * step + 3]).loss
            curve.append((loss, model.clip_grad_and_step()["grad_norm"]))
        curves[device] = curve
    for (loss, norm), (cpu_loss, cpu_norm) in zip(curves["cuda"], curves["cpu"], strict=True):
        assert loss == pytest.approx(cpu_loss, rel=loss_tolerance) and norm == pytest.approx(
            cpu_norm, rel=norm_tolerance
        )
