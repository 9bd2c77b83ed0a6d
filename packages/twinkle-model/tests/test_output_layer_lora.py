"""LoRA on the output layer (``lm_head``): ``MultiLoraModel`` equals plain PEFT with the embedding tied.

``builtin://qwen3-tiny`` ties ``lm_head`` to ``embed_tokens``. PEFT, given
``lm_head`` as a target, wraps the output projection only: the shared weight
stays frozen and the embedding lookup never sees the update. The adapter
``head`` (LoRA on ``q_proj`` and ``lm_head``) trains here beside ``body`` (every
linear layer but the output one) in shared passes, so the output layer sees
rows of both adapters in one chunk; the reference is hand-written
transformers + peft + torch.optim code, one model per adapter.

The output layer runs over 5 positions at a time, so its chunks cut across
rows and adapters. ``TransformersModel`` (PEFT itself) saves such an adapter
without the frozen base weight PEFT would add.

Both sides run in float64 so the tolerance holds on any CPU: float64 round-off
is ~1e-15, while a wrong row, a missing head update or an update leaking into
the embedding moves the numbers by far more than 1e-8.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle.data_format import IGNORE_INDEX, make_input_feature
from twinkle.hub import resolve_model
from twinkle.model import AdapterRequest, MultiLoraModel, TargetSequence, TransformersModel

DTYPE = torch.float64
TOL = {"atol": 1e-8, "rtol": 1e-8}
# PEFT warns that a tied layer is a target; adapting the output projection alone is what is wanted here.
pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
LR = 1e-2
CONFIGS = {
    "head": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0),
    "body": LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", lora_dropout=0.0),
}


def _features(seed: int, lengths: list[int]) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    features = []
    for length in lengths:
        ids = torch.randint(0, 5000, (length,), generator=generator).tolist()
        features.append(make_input_feature(ids, [IGNORE_INDEX] * (length // 2) + ids[length // 2 :]))
    return features


BATCHES = {"head": _features(1, [9, 12, 7]), "body": _features(2, [11, 8])}


def _base() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=DTYPE, attn_implementation="sdpa")


def _reference(name: str, payload: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = get_peft_model(_base(), copy.deepcopy(CONFIGS[name]))
    result = set_peft_model_state_dict(model, {key: tensor.detach().clone() for key, tensor in payload.items()})
    assert not result.unexpected_keys
    assert not [key for key in result.missing_keys if "lora_" in key]
    return model.train()


def _peft_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """PEFT's LoRA parameters under the keys of ``MultiLoraModel.lora_payload`` (adapter name dropped)."""
    return {
        name.replace(".default.weight", ".weight"): param for name, param in model.named_parameters() if "lora_" in name
    }


def _reference_ce(model: torch.nn.Module, batch: list[dict]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Token-mean cross-entropy over the batch, and each sample's log-probs (0 where unsupervised)."""
    total, count, logps = 0.0, 0, []
    for feature in batch:
        logits = model(input_ids=torch.tensor([feature["input_ids"]])).logits[0]
        labels = torch.tensor(feature["labels"])
        total = total + F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="sum")
        count += int((labels[1:] != IGNORE_INDEX).sum())
        picked = torch.log_softmax(logits[:-1], -1).gather(-1, labels[1:].clamp(min=0)[:, None]).squeeze(-1)
        logps.append(torch.cat([picked.new_zeros(1), torch.where(labels[1:] != IGNORE_INDEX, picked, 0.0)]))
    return total / count, logps


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = MultiLoraModel(device="cpu", max_loras=3, max_rank=8, dtype=DTYPE, logps_chunk_size=5)
    references = {}
    for index, (name, config) in enumerate(CONFIGS.items()):
        model.add_adapter_to_model(name, config)
        _, payload = model.lora_payload(name)
        generator = torch.Generator().manual_seed(10 + index)
        with torch.no_grad():  # B = 0 would start every adapter as the base model
            for key, tensor in payload.items():
                if ".lora_B." in key:
                    tensor.normal_(0, 0.05, generator=generator)
        references[name] = _reference(name, payload)
        model.set_optimizer("AdamW", adapter_name=name, lr=LR)
    return model, references


def test_lm_head_is_a_target_and_the_embedding_stays_tied(setup):
    model, _ = setup
    keys = model.lora_payload("head")[1]
    assert "base_model.model.lm_head.lora_B.weight" in keys
    assert keys["base_model.model.lm_head.lora_B.weight"].shape[0] == model.vocab_size
    assert not [key for key in model.lora_payload("body")[1] if "lm_head" in key], "'all-linear' leaves lm_head out"
    embedding, head = model.model.get_input_embeddings(), model.model.get_output_embeddings()
    assert head.weight is embedding.weight  # still one tensor: nothing was untied or copied


def test_a_shared_step_equals_plain_peft_and_leaves_the_embedding_alone(setup):
    model, references = setup
    embedding_before = model.model.get_input_embeddings().weight.detach().clone()
    results = model.forward_backward_many([AdapterRequest(name, batch) for name, batch in BATCHES.items()])
    assert all(result.ok for result in results), [result.error for result in results]
    for name, result in zip(BATCHES, results, strict=True):
        reference = references[name]
        loss, logps = _reference_ce(reference, BATCHES[name])
        loss.backward()
        assert result.output.loss == pytest.approx(float(loss.detach()), rel=1e-10)
        for ours, theirs in zip(result.output.logps, logps, strict=True):
            torch.testing.assert_close(ours.double(), theirs.detach(), **TOL)
        params, ours = _peft_params(reference), model.lora_payload(name)[1]
        assert set(ours) == set(params)
        for key, tensor in ours.items():
            assert params[key].grad.abs().sum() > 0, f"{key}: a zero reference gradient makes the check vacuous"
            torch.testing.assert_close(tensor.grad, params[key].grad, **TOL, msg=lambda m, k=key: f"{k}: {m}")
        optimizer = torch.optim.AdamW(list(params.values()), lr=LR)
        optimizer.step()
        model.clip_grad_and_step(max_grad_norm=1e9, adapter_name=name)
        for key, tensor in ours.items():
            torch.testing.assert_close(tensor.detach(), params[key].detach(), **TOL, msg=lambda m, k=key: f"{k}: {m}")
    # The output-layer update trained, the tied embedding it shares a weight with did not move.
    assert torch.equal(model.model.get_input_embeddings().weight, embedding_before)
    assert all(not param.requires_grad and param.grad is None for param in model.model.parameters())


@pytest.mark.parametrize("width", [1, 2])
def test_tinker_targets_through_an_adapted_head_equal_plain_peft(setup, width):
    """``forward_backward_targets`` (the Tinker path): one target id per position, or a second sequence with two."""
    model, references = setup
    generator = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 5000, (n,), generator=generator) for n in (8, 5, 6)]
    shapes = [(8,), (5, width) if width > 1 else (5,), (6,)]
    targets = [torch.randint(0, 5000, shape, generator=generator) for shape in shapes]
    weights = [torch.rand(target.shape, generator=generator, dtype=DTYPE) for target in targets]

    def loss_fn(logps):
        loss = -sum((lp * w).sum() for lp, w in zip(logps, weights, strict=True))
        return loss, {}

    model.zero_grad(adapter_name="head")
    output = model.forward_backward_targets(
        [TargetSequence(t, y) for t, y in zip(tokens, targets, strict=True)], loss_fn, adapter_name="head"
    )
    reference = references["head"]
    for param in reference.parameters():
        param.grad = None
    reference_logps = []
    for ids, target in zip(tokens, targets, strict=True):
        logprobs = torch.log_softmax(reference(input_ids=ids[None]).logits[0], -1)
        reference_logps.append(logprobs.gather(-1, target.reshape(len(ids), -1)).reshape(target.shape))
    loss, _ = loss_fn(reference_logps)
    loss.backward()
    assert output.loss == pytest.approx(float(loss.detach()), rel=1e-10)
    for ours, theirs in zip(output.logps, reference_logps, strict=True):  # reported in float32
        torch.testing.assert_close(ours.double(), theirs.detach(), atol=1e-5, rtol=1e-6)
    params = _peft_params(reference)
    for key, tensor in model.lora_payload("head")[1].items():
        torch.testing.assert_close(tensor.grad, params[key].grad, **TOL, msg=lambda m, k=key: f"{k}: {m}")
    model.zero_grad(adapter_name="head")


def test_the_saved_adapter_loads_in_plain_peft_with_equal_logits(setup, tmp_path):
    model, _ = setup
    features = BATCHES["head"]
    path = model.save("head-ckpt", output_dir=tmp_path, adapter_name="head", save_optimizer=False)
    ours = model.forward_only(features, adapter_name="head", return_logits=True).logits
    plain = PeftModel.from_pretrained(_base(), path).eval()
    without_head = copy.deepcopy(plain)
    with torch.no_grad():
        without_head.get_base_model().lm_head.lora_B["default"].weight.zero_()
        for feature, logits in zip(features, ours, strict=True):
            ids = torch.tensor([feature["input_ids"]])
            torch.testing.assert_close(logits.double(), plain(input_ids=ids).logits[0], **TOL)
            # The output layer's update is part of those logits: without it they differ by far more.
            assert (plain(input_ids=ids).logits - without_head(input_ids=ids).logits).abs().max() > 1e-3


def test_transformers_model_saves_an_lm_head_adapter_without_the_base_weight(tmp_path):
    model = TransformersModel(device="cpu", dtype=DTYPE)
    model.add_adapter_to_model("default", CONFIGS["head"])
    model.set_optimizer("AdamW", lr=LR)
    model.forward_backward(inputs=BATCHES["head"])
    model.clip_grad_and_step()
    path = model.save("ckpt", output_dir=tmp_path, save_optimizer=False)
    saved = set(load_file(f"{path}/adapter_model.safetensors"))
    assert "base_model.model.lm_head.lora_B.weight" in saved
    assert not [key for key in saved if "base_layer" in key], "the frozen output layer is not part of the adapter"
    ours = model.forward_only(BATCHES["head"], return_logits=True).logits
    plain = PeftModel.from_pretrained(_base(), path).eval()
    with torch.no_grad():
        for feature, logits in zip(BATCHES["head"], ours, strict=True):
            reference = plain(input_ids=torch.tensor([feature["input_ids"]])).logits[0]
            torch.testing.assert_close(logits.double(), reference, **TOL)
