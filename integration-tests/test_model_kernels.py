"""Models and samplers built with ``kernels=`` and ``patches=``: the numbers they computed without, and a report.

The Triton kernels run on the CPU in Triton's interpreter, on a small Qwen3 (vocabulary 320) so that the
interpreter stays quick. Kernels compute in float32 in another order than PyTorch, so values are compared to a
bound of float32 round-off relative to each tensor's largest element (1e-4: thousands of ulps), far below what a
wrong kernel, mask or adapter routing changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from twinkle.data_format import SamplingParams
from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.kernel import OUTPUT_LOGPS, get_kernel_report
from twinkle.model import AdapterRequest, MultiLoraModel, TransformersModel
from twinkle.patch import accelerate, applied_patches
from twinkle.sampler import TorchSampler

pytest.importorskip("triton")

VOCAB = 320
BATCH = [
    {"input_ids": [5, 17, 42, 99, 7, 301, 12], "labels": [-100, -100, 42, 99, 7, 301, 12]},
    {"input_ids": [8, 3, 250, 66, 19], "labels": [-100, 3, 250, 66, 19]},
]
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        pad_token_id=0,  # the sampler pads with it (the tokenizer's own ids lie outside this vocabulary)
        eos_token_id=1,
    )
    path = tmp_path_factory.mktemp("qwen3-small")
    Qwen3ForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(path)  # the sampler decodes with it
    return str(path)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    bound = 1e-4 * expected.abs().max().item() + 1e-7
    assert (actual - expected).abs().max().item() <= bound, what


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.model.named_parameters() if p.grad is not None}


def _lora_step(model_dir: str, **options: Any) -> tuple[TransformersModel, Any, dict[str, torch.Tensor]]:
    model = TransformersModel(model_dir, device="cpu", **options)
    model.add_adapter_to_model("a", LoraConfig(**LORA, target_modules="all-linear"), seed=0)
    model.set_optimizer("SGD", lr=0.1)
    return model, model.forward_backward(BATCH), _grads(model)


def test_a_kernelized_lora_model_computes_what_the_plain_one_does(model_dir: str) -> None:
    plain, expected, expected_grads = _lora_step(model_dir)
    model, output, grads = _lora_step(model_dir, kernels=True)
    report = get_kernel_report(model.model)
    assert report is not None
    assert {"Qwen3RMSNorm", "Qwen3MLP", "Qwen3Attention"} <= set(report.replaced), str(report)
    assert report.kernels[OUTPUT_LOGPS].op == "linear_logps"
    assert get_kernel_report(plain.model) is None
    _close(torch.tensor(output.loss), torch.tensor(expected.loss), "loss")
    for ours, theirs in zip(output.logps, expected.logps, strict=True):
        _close(ours, theirs, "logps")
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in expected_grads.items():
        _close(grads[name], grad, name)


def test_multi_lora_layers_added_later_get_the_kernel_and_the_same_gradients(model_dir: str) -> None:
    # "b" adapts the output layer: its low-rank term goes through the fused log-prob kernel
    targets = {"a": ["q_proj", "v_proj", "down_proj"], "b": ["lm_head", "up_proj"]}

    def shared_pass(**options: Any) -> tuple[MultiLoraModel, dict[str, torch.Tensor]]:
        model = MultiLoraModel(model_dir, device="cpu", **options)
        for rank, (name, modules) in enumerate(targets.items(), start=2):
            model.add_adapter_to_model(name, LoraConfig(**{**LORA, "r": rank}, target_modules=modules), seed=rank)
            for param in model.train_state(name).params:  # B = 0 would hide a wrong routing
                torch.nn.init.normal_(param, std=0.1)
        for result in model.forward_backward_many([AdapterRequest("a", BATCH), AdapterRequest("b", BATCH[::-1])]):
            assert result.error is None, result.error
        grads = {}
        for name in targets:
            for index, param in enumerate(model.train_state(name).params):
                grads[f"{name}.{index}"] = param.grad.clone()
        return model, grads

    torch.manual_seed(1)
    _, expected = shared_pass()
    torch.manual_seed(1)
    model, grads = shared_pass(kernels=True)
    report = get_kernel_report(model.model)
    assert report is not None and report.replaced["MultiLoraLinear"] == "TritonMultiLora", str(report)
    entry = next(entry for entry in report.entries if entry.target == "MultiLoraLinear")
    assert len(entry.modules) == 3 * 2 + 2 + 1  # both adapters' targets in both layers, and lm_head
    assert grads.keys() == expected.keys() and len(grads) == 2 * len(entry.modules)
    for name, grad in expected.items():
        _close(grads[name], grad, name)


def test_a_kernelized_sampler_samples_the_same_tokens_and_logprobs(model_dir: str) -> None:
    prompts = [{"input_ids": row["input_ids"]} for row in BATCH]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    plain = TorchSampler(model_dir, device="cpu").sample(prompts, params)
    sampler = TorchSampler(model_dir, device="cpu", kernels={"Qwen3RMSNorm": "rms_norm", "Qwen3MLP": "TritonSwiGLU"})
    report = get_kernel_report(sampler.model)
    assert report is not None and report.replaced == {"Qwen3RMSNorm": "TritonRMSNorm", "Qwen3MLP": "TritonSwiGLU"}
    kernelized = sampler.sample(prompts, params)
    for ours, theirs in zip(kernelized.sequences, plain.sequences, strict=True):
        assert ours.tokens == theirs.tokens
        _close(torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), "logprobs")


def test_patches_go_into_the_model(model_dir: str) -> None:
    model = TransformersModel(model_dir, device="cpu", patches=["FusedLinearLogpsPatch"])
    assert applied_patches(model.model) == ["FusedLinearLogpsPatch"]
    batch = {name: torch.tensor([row[name] for row in BATCH[1:]]) for name in ("input_ids", "labels")}
    output = model.model(**batch)
    assert output.logits is None and torch.isfinite(output.loss)
    plain = TransformersModel(model_dir, device="cpu").model(**batch)
    _close(output.loss, plain.loss, "loss")
    with pytest.raises(ConfigurationError, match="kernels must be True"):
        TransformersModel(model_dir, device="cpu", kernels="yes")


def test_a_failing_kernel_or_patch_leaves_the_model_as_it_was(model_dir: str) -> None:
    model = Qwen3ForCausalLM.from_pretrained(model_dir)
    attributes = {name: dict(module.__dict__) for name, module in model.named_modules()}
    with pytest.raises(ConfigurationError, match="Template or a tokenizer"):
        accelerate(model, True, ["FusedLinearLogpsPatch", "Qwen3ThinkingTemplatePatch"])
    with pytest.raises(ConfigurationError, match="unknown kernel or op 'no_such_op'"):
        accelerate(model, {"Qwen3RMSNorm": "rms_norm", "Qwen3MLP": "no_such_op"}, ["FusedLinearLogpsPatch"])
    assert applied_patches(model) == [] and get_kernel_report(model) is None
    for name, module in model.named_modules():
        assert module.__dict__.keys() == attributes[name].keys(), name
