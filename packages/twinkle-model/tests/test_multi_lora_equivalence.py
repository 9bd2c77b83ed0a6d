"""Acceptance test: adapters trained together by ``MultiLoraModel`` equal each adapter trained alone in plain PEFT.

Four adapters of ranks 1, 8, 16 and 64 — each with its own target modules,
loss, optimizer, learning rate and clipping — train for three steps in shared
``forward_backward_many`` passes. The reference trains each adapter alone with
hand-written transformers + peft + torch.optim code (losses from their formulas,
not Twinkle's loss classes) from the same initial weights: per-adapter losses,
log-probabilities, gradients, gradient norms and weights must agree.

Both sides run in float64. In float32 the two implementations sum the same products in different orders
(which order depends on the CPU's vector width: AVX-512, AVX2 or scalar kernels), so their gradients differ by
~1e-6 of the largest element; an optimizer step divides by ``sqrt(v) + eps`` and turns a round-off-sized
difference on a tiny gradient element into a weight difference of up to ~lr, which no fixed fp32 tolerance bounds
on every x86 CPU. In float64 that round-off is ~1e-15, so the 1e-8 tolerance below holds on any CPU while any
real difference (a wrong normaliser, scale, mask, clip or optimizer state) is orders of magnitude larger.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.errors import InvalidInputError
from twinkle.hub import resolve_model
from twinkle.model import AdapterRequest, MultiLoraModel

STEPS = 3
TOL = {"atol": 1e-8, "rtol": 1e-8}  # float64 round-off after 3 steps is ~1e-13 (every CPU kernel width)
DTYPE = torch.float64  # see the module docstring
GRPO_EPS = 0.2
DPO_BETA = 0.5


@dataclass
class Spec:
    """One tenant: its adapter, loss, optimizer and batches (sizes; lengths drawn per step)."""

    name: str
    config: LoraConfig
    loss: str  # "ce_token", "grpo", "dpo" or "ce_sequence"
    optimizer: tuple[type[torch.optim.Optimizer], dict[str, Any]]
    max_grad_norm: float
    batch_size: int
    scheduler: tuple[type[Any], dict[str, Any]] | None = None
    batches: list[list[dict[str, Any]]] = field(default_factory=list)
    loss_inputs: list[dict[str, Any]] = field(default_factory=list)


def _specs() -> list[Spec]:
    return [
        Spec(
            "sft",
            LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", lora_dropout=0.0),
            "ce_token",
            (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05}),
            max_grad_norm=1.0,
            batch_size=3,
        ),
        Spec(
            "rl",
            LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
            "grpo",
            (torch.optim.SGD, {"lr": 0.5, "momentum": 0.9, "nesterov": True}),
            max_grad_norm=0.05,  # binds: the clipping itself is compared
            batch_size=4,
            scheduler=(torch.optim.lr_scheduler.StepLR, {"step_size": 1, "gamma": 0.5}),
        ),
        Spec(
            "pref",
            LoraConfig(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=0.0),
            "dpo",
            (torch.optim.Adam, {"lr": 3e-3, "betas": (0.8, 0.95)}),
            max_grad_norm=1e6,
            batch_size=4,  # 2 pairs: 2 chosen, then their 2 rejected
        ),
        Spec(
            "seq",
            LoraConfig(r=64, lora_alpha=32, use_rslora=True, target_modules=["o_proj", "k_proj"], lora_dropout=0.0),
            "ce_sequence",
            (torch.optim.RMSprop, {"lr": 1e-3, "alpha": 0.9}),
            max_grad_norm=2.0,
            batch_size=2,
        ),
    ]


IDLE = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)

# ---------------------------------------------------------------------------------------------------- data


def _feature(generator: torch.Generator, length: int) -> dict[str, Any]:
    """Random tokens; the first ~half is the prompt (IGNORE_INDEX labels), the rest is trained."""
    ids = torch.randint(0, 5000, (length,), generator=generator).tolist()
    prompt = int(torch.randint(2, length // 2 + 1, (1,), generator=generator))
    return make_input_feature(ids, [IGNORE_INDEX] * prompt + ids[prompt:])


def _batches(generator: torch.Generator, batch_size: int) -> list[list[dict[str, Any]]]:
    return [
        [_feature(generator, int(torch.randint(7, 19, (1,), generator=generator))) for _ in range(batch_size)]
        for _ in range(STEPS)
    ]


# ---------------------------------------------------------------------------------------------------- reference


def _reference_model(config: LoraConfig, payload: dict[str, torch.Tensor]) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(
        resolve_model("builtin://qwen3-tiny"), dtype=DTYPE, attn_implementation="sdpa"
    )
    model = get_peft_model(base, copy.deepcopy(config))
    assert set(get_peft_model_state_dict(model)) == set(payload)  # PEFT resolves the same target modules
    result = set_peft_model_state_dict(model, {key: tensor.detach().clone() for key, tensor in payload.items()})
    assert not result.unexpected_keys
    assert not [key for key in result.missing_keys if "lora_" in key]
    return model.train()


def _lora_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """PEFT's LoRA parameters under the keys of ``MultiLoraModel.lora_payload`` (adapter name dropped)."""
    return {
        name.replace(".default.weight", ".weight"): param for name, param in model.named_parameters() if "lora_" in name
    }


def _reference_logps(model: torch.nn.Module, feature: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits[T, V]`` and ``logps[T]``: log p(labels[t] | tokens < t) on trained positions, 0 elsewhere."""
    ids = torch.tensor([feature["input_ids"]])
    logits = model(input_ids=ids).logits[0]
    labels = torch.tensor(feature["labels"])
    trained = labels[1:] != IGNORE_INDEX
    picked = torch.log_softmax(logits[:-1], -1).gather(-1, labels[1:].clamp(min=0)[:, None]).squeeze(-1)
    return logits, torch.cat([picked.new_zeros(1), torch.where(trained, picked, torch.zeros_like(picked))])


def _reference_loss(spec: Spec, model: torch.nn.Module, batch: list[dict], inputs: dict) -> tuple[torch.Tensor, list]:
    """The loss from its formula, and each sample's per-position logps."""
    results = [_reference_logps(model, feature) for feature in batch]
    logps = [logps for _, logps in results]
    labels = [torch.tensor(feature["labels"]) for feature in batch]
    if spec.loss == "ce_token":  # mean over every trained token of the batch
        total = sum(
            F.cross_entropy(logits[:-1], lb[1:], ignore_index=IGNORE_INDEX, reduction="sum")
            for (logits, _), lb in zip(results, labels, strict=True)
        )
        loss = total / sum(int((lb[1:] != IGNORE_INDEX).sum()) for lb in labels)
    elif spec.loss == "ce_sequence":  # each sequence's token mean, averaged over sequences
        per_sequence = [
            F.cross_entropy(logits[:-1], lb[1:], ignore_index=IGNORE_INDEX)
            for (logits, _), lb in zip(results, labels, strict=True)
        ]
        loss = torch.stack(per_sequence).mean()
    elif spec.loss == "grpo":  # token mean of -min(r·A, clip(r, 1-ε, 1+ε)·A), r = exp(lp - old_lp)
        token_losses = []
        for lp, lb, advantage, old in zip(logps, labels, inputs["advantages"], inputs["old_logps"], strict=True):
            ratio = torch.exp(lp[lb != IGNORE_INDEX] - torch.tensor(old, dtype=lp.dtype))
            clipped = ratio.clamp(1 - GRPO_EPS, 1 + GRPO_EPS)
            token_losses.append(-torch.min(ratio * advantage, clipped * advantage))
        loss = torch.cat(token_losses).mean()
    else:  # DPO (sigmoid): mean over pairs of -log σ(β·((lp_c − ref_c) − (lp_r − ref_r)))
        log_ratios = torch.stack([lp.sum() for lp in logps]) - torch.tensor(inputs["ref_logps"], dtype=torch.float64)
        chosen, rejected = log_ratios.chunk(2)
        loss = -F.logsigmoid(DPO_BETA * (chosen - rejected)).mean()
    return loss, logps


# ---------------------------------------------------------------------------------------------------- Twinkle side


def _twinkle_loss(model: MultiLoraModel, spec: Spec) -> None:
    if spec.loss == "ce_token":
        model.set_loss("CrossEntropyLoss", adapter_name=spec.name)
    elif spec.loss == "ce_sequence":
        model.set_loss("CrossEntropyLoss", adapter_name=spec.name, reduction="sequence_mean")
    elif spec.loss == "grpo":
        model.set_loss("GRPOLoss", adapter_name=spec.name, epsilon=GRPO_EPS)
    else:
        model.set_loss("DPOLoss", adapter_name=spec.name, beta=DPO_BETA)


def _setup():
    """The Twinkle model with every adapter (B perturbed), its reference models, and each step's data."""
    torch.manual_seed(0)
    model = MultiLoraModel(device="cpu", max_loras=5, max_rank=64, dtype=DTYPE)
    specs = _specs()
    references = {}
    for index, spec in enumerate(specs):
        model.add_adapter_to_model(spec.name, spec.config)
        _, payload = model.lora_payload(spec.name)
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():  # B = 0 would make every adapter start as the base model
            for key, tensor in payload.items():
                if ".lora_B." in key:
                    tensor.normal_(0, 0.05, generator=generator)
        references[spec.name] = _reference_model(spec.config, payload)
        optimizer_cls, kwargs = spec.optimizer
        model.set_optimizer(optimizer_cls, adapter_name=spec.name, **kwargs)
        if spec.scheduler:
            model.set_lr_scheduler(spec.scheduler[0], adapter_name=spec.name, **spec.scheduler[1])
        _twinkle_loss(model, spec)
    model.add_adapter_to_model("idle", IDLE)  # never in a request: must never get a gradient

    generator = torch.Generator().manual_seed(7)
    for spec in specs:
        spec.batches = _batches(generator, spec.batch_size)
        for batch in spec.batches:
            if spec.loss == "grpo":  # a sampler's log-probs: the initial policy's, perturbed so some ratios clip
                with torch.no_grad():
                    logps = [_reference_logps(references[spec.name], feature)[1] for feature in batch]
                trained_logps = [
                    lp[torch.tensor(f["labels"]) != IGNORE_INDEX] for lp, f in zip(logps, batch, strict=True)
                ]
                old = [(lp + 0.15 * torch.randn(lp.shape, generator=generator)).tolist() for lp in trained_logps]
                advantages = torch.randn(len(batch), generator=generator).tolist()
                spec.loss_inputs.append({"advantages": advantages, "old_logps": old})
            elif spec.loss == "dpo":
                with torch.no_grad():
                    sums = [float(_reference_logps(references[spec.name], f)[1].sum()) for f in batch]
                noise = torch.randn(len(batch), generator=generator).tolist()
                spec.loss_inputs.append({"ref_logps": [s + 2 * n for s, n in zip(sums, noise, strict=True)]})
            else:
                spec.loss_inputs.append({})
    return model, specs, references


def _twinkle_params(model: MultiLoraModel, name: str) -> dict[str, torch.Tensor]:
    return model.lora_payload(name)[1]


# ---------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def trained():
    """Run both sides for STEPS steps, comparing as they go; returns what the checks below need."""
    model, specs, references = _setup()
    idle_before = {k: t.detach().clone() for k, t in _twinkle_params(model, "idle").items()}
    initial = {
        spec.name: {k: t.detach().clone() for k, t in _twinkle_params(model, spec.name).items()} for spec in specs
    }
    optimizers, schedulers = {}, {}
    for spec in specs:
        params = _lora_params(references[spec.name])
        optimizers[spec.name] = spec.optimizer[0](list(params.values()), **spec.optimizer[1])
        if spec.scheduler:
            schedulers[spec.name] = spec.scheduler[0](optimizers[spec.name], **spec.scheduler[1])
    log = []
    for step in range(STEPS):
        requests = [AdapterRequest(spec.name, spec.batches[step], loss_inputs=spec.loss_inputs[step]) for spec in specs]
        results = model.forward_backward_many(requests)
        assert [r.adapter_name for r in results] == [spec.name for spec in specs]
        assert all(r.ok for r in results), [r.error for r in results]
        # Gradients only ever reach adapter tensors of adapters in the request.
        assert all(param.grad is None for param in model.model.parameters())
        assert all(tensor.grad is None for tensor in _twinkle_params(model, "idle").values())
        for spec, result in zip(specs, results, strict=True):
            reference = references[spec.name]
            optimizer = optimizers[spec.name]
            optimizer.zero_grad(set_to_none=True)
            loss, logps = _reference_loss(spec, reference, spec.batches[step], spec.loss_inputs[step])
            loss.backward()
            params = _lora_params(reference)
            ours = _twinkle_params(model, spec.name)
            grads = {key: (ours[key].grad.clone(), params[key].grad.clone()) for key in ours}
            assert all(ours[key].grad is not None for key in ours)
            norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), spec.max_grad_norm))
            optimizer.step()
            if spec.name in schedulers:
                schedulers[spec.name].step()
            stepped = model.clip_grad_and_step(spec.max_grad_norm, adapter_name=spec.name)
            assert stepped["stepped"] is True and stepped["global_step"] == step + 1
            weights = {key: (ours[key].detach().clone(), params[key].detach().clone()) for key in ours}
            log.append(
                {
                    "step": step,
                    "spec": spec,
                    "loss": (result.output.loss, float(loss.detach())),
                    "num_tokens": (result.output.num_tokens, sum(int((lp != 0).sum()) for lp in logps)),
                    "logps": (result.output.logps, [lp.detach() for lp in logps]),
                    "grads": grads,
                    "grad_norm": (stepped["grad_norm"], norm),
                    "lr": (stepped["lr"], optimizer.param_groups[0]["lr"]),
                    "weights": weights,
                }
            )
        assert all(tensor.grad is None for spec in specs for tensor in _twinkle_params(model, spec.name).values())
    return {"model": model, "specs": specs, "log": log, "idle_before": idle_before, "initial": initial}


def _entries(trained, name=None):
    return [entry for entry in trained["log"] if name is None or entry["spec"].name == name]


@pytest.mark.parametrize("name", ["sft", "rl", "pref", "seq"])
def test_losses_and_logps_equal_plain_peft(trained, name):
    for entry in _entries(trained, name):
        ours, reference = entry["loss"]
        assert ours == pytest.approx(reference, rel=1e-5, abs=1e-5), f"step {entry['step']}"
        assert entry["num_tokens"][0] == entry["num_tokens"][1] > 0
        our_logps, reference_logps = entry["logps"]
        assert len(our_logps) == len(reference_logps)
        for mine, theirs in zip(our_logps, reference_logps, strict=True):  # results are reported in float32
            torch.testing.assert_close(mine.double(), theirs, **TOL)


@pytest.mark.parametrize("name", ["sft", "rl", "pref", "seq"])
def test_gradients_equal_plain_peft(trained, name):
    for entry in _entries(trained, name):
        assert entry["grads"]
        for key, (ours, reference) in entry["grads"].items():
            assert reference.abs().sum() > 0, f"{key}: the reference gradient is zero, the check would be vacuous"
            torch.testing.assert_close(
                ours, reference, **TOL, msg=lambda m, k=key, e=entry: f"step {e['step']} {k}: {m}"
            )
        ours, reference = entry["grad_norm"]
        assert ours == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("name", ["sft", "rl", "pref", "seq"])
def test_weights_equal_plain_peft_after_every_step(trained, name):
    entries = _entries(trained, name)
    assert len(entries) == STEPS
    for entry in entries:
        ours, reference = entry["lr"]
        assert ours == pytest.approx(reference)
        for key, (mine, theirs) in entry["weights"].items():
            torch.testing.assert_close(mine, theirs, **TOL, msg=lambda m, k=key, e=entry: f"step {e['step']} {k}: {m}")
    # Training moved every tensor far beyond the tolerance, so the agreement is not that of untouched weights.
    for key, (final, _) in entries[-1]["weights"].items():
        assert (final - trained["initial"][name][key]).abs().max() > 5e-4, key


def test_setup_covers_the_issue(trained):
    """Ranks 1, 8, 16, 64; different targets, losses and optimizers; B non-zero from the start."""
    model, specs = trained["model"], trained["specs"]
    assert sorted(model.adapter_config(spec.name).r for spec in specs) == [1, 8, 16, 64]
    assert len({spec.loss for spec in specs}) == len(specs)
    assert len({spec.optimizer[0] for spec in specs}) == len(specs)
    targets = {
        spec.name: {key.split(".lora_")[0].rsplit(".", 1)[1] for key in _twinkle_params(model, spec.name)}
        for spec in specs
    }
    assert targets == {
        "sft": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
        "rl": {"q_proj", "v_proj"},
        "pref": {"gate_proj", "up_proj", "down_proj"},
        "seq": {"o_proj", "k_proj"},
    }
    for spec in specs:
        assert all(t.abs().sum() > 0 for k, t in trained["initial"][spec.name].items() if ".lora_B." in k)


def test_adapters_not_in_the_request_and_the_base_stay_untouched(trained):
    model = trained["model"]
    for key, tensor in _twinkle_params(model, "idle").items():
        assert tensor.grad is None
        assert torch.equal(tensor.detach(), trained["idle_before"][key])
    assert model.train_state("idle").counters() == {
        "global_step": 0,
        "accumulated": 0,
        "gradient_accumulation_steps": 1,
    }
    assert all(not param.requires_grad and param.grad is None for param in model.model.parameters())


def test_micro_batch_size_gives_the_same_gradients():
    """micro_batch_size=2 cuts the shared batch into 2-row passes: the same losses, log-probs and gradients.

    Rows sft0 sft1 | sft2 rl0 | rl1 rl2 | rl3 seq0 | seq1: every adapter's rows are split. DPO is left
    out: a preference loss must see all its pairs in one pass (``twinkle.loss.preference``), which
    micro-batches cut across the concatenated requests cannot promise.
    """
    model, specs, _ = _setup()
    specs = [spec for spec in specs if spec.loss != "dpo"]
    requests = [AdapterRequest(spec.name, spec.batches[0], loss_inputs=spec.loss_inputs[0]) for spec in specs]
    outputs, grads = {}, {}
    for micro_batch_size in (None, 2):
        results = model.forward_backward_many(requests, micro_batch_size=micro_batch_size)
        assert all(r.ok for r in results), [r.error for r in results]
        outputs[micro_batch_size] = [r.output for r in results]
        grads[micro_batch_size] = {
            spec.name: {key: t.grad.clone() for key, t in _twinkle_params(model, spec.name).items()} for spec in specs
        }
        for spec in specs:
            model.zero_grad(adapter_name=spec.name)
    for whole, split in zip(outputs[None], outputs[2], strict=True):
        assert split.loss == pytest.approx(whole.loss, rel=1e-5, abs=1e-6)
        assert split.num_tokens == whole.num_tokens
        for mine, theirs in zip(split.logps, whole.logps, strict=True):
            torch.testing.assert_close(mine, theirs, **TOL)
    for spec in specs:
        for key, grad in grads[None][spec.name].items():
            torch.testing.assert_close(grads[2][spec.name][key], grad, **TOL)


def test_a_pairwise_request_is_refused_micro_batches_alone():
    """A DPO request in a micro-batched pass gets an error naming the cause; the others train untouched."""
    model, specs, _ = _setup()
    requests = [AdapterRequest(spec.name, spec.batches[0], loss_inputs=spec.loss_inputs[0]) for spec in specs]
    results = model.forward_backward_many(requests, micro_batch_size=2)
    for spec, result in zip(specs, results, strict=True):
        if spec.loss == "dpo":
            assert isinstance(result.error, InvalidInputError), result.error
            assert "micro_batch_size=None" in str(result.error)
            assert all(t.grad is None for t in _twinkle_params(model, spec.name).values())
        else:
            assert result.ok, result.error
