"""``kernelize`` on the shipped families: same logits and gradients, and an exact undo."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from twinkle.errors import ConfigurationError
from twinkle.hub import resolve_model
from twinkle.kernel import OUTPUT_LOGPS, get_kernel_report, kernelize, rms_norm_reference, select_kernel, unkernelize

pytest.importorskip("triton")

SMALL = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _models() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [
        AutoModelForCausalLM.from_pretrained(resolve_model(None), dtype=torch.float32),
        LlamaForCausalLM(LlamaConfig(**SMALL, **HEADS)),
        Qwen2ForCausalLM(Qwen2Config(**SMALL, **HEADS)),
    ]


def _logits_and_grads(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(input_ids).logits
    torch.log_softmax(logits, dim=-1)[..., :7].sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model", _models(), ids=["qwen3", "llama", "qwen2"])
def test_kernelized_family_equals_the_original_and_undoes_exactly(model: torch.nn.Module) -> None:
    input_ids = torch.randint(0, 300, (2, 9))
    logits, grads = _logits_and_grads(model, input_ids)
    attributes = {name: dict(module.__dict__) for name, module in model.named_modules()}
    report = kernelize(model)
    assert {"rms_norm", "swiglu", "rotary"} <= {e.op for e in report.entries if e.kernel}, str(report)
    assert report.kernels[OUTPUT_LOGPS].op == "linear_logps"
    assert get_kernel_report(model) is report
    kernel_logits, kernel_grads = _logits_and_grads(model, input_ids)
    # fp32 kernels against the same fp32 model: rounding differs in the order of a few ulps per layer.
    assert torch.allclose(kernel_logits, logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        assert (kernel_grads[name] - grad).abs().max() <= 1e-4 * grad.abs().max() + 1e-7, name
    with pytest.raises(ConfigurationError, match="already kernelized"):
        kernelize(model)
    unkernelize(model)
    assert get_kernel_report(model) is None
    assert {name: dict(module.__dict__) for name, module in model.named_modules()}.keys() == attributes.keys()
    for name, module in model.named_modules():
        assert module.__dict__.keys() == attributes[name].keys(), name
    assert torch.equal(_logits_and_grads(model, input_ids)[0], logits)


def test_unavailable_kernels_are_reported_and_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: Triton cannot run
    model = LlamaForCausalLM(LlamaConfig(**SMALL, **HEADS))
    report = kernelize(model)
    assert report.replaced == {}
    assert all("CUDA" in (entry.reason or "") for entry in report.entries if entry.modules), str(report)
    assert all("forward" not in module.__dict__ for module in model.modules())
    unkernelize(model)


def test_mappings_by_name_and_bad_mappings() -> None:
    model = LlamaForCausalLM(LlamaConfig(**SMALL, **HEADS))
    report = kernelize(model, {"LlamaRMSNorm": "TritonRMSNorm"})
    assert report.replaced == {"LlamaRMSNorm": "TritonRMSNorm"}
    unkernelize(model)
    with pytest.raises(ConfigurationError, match="unknown kernel or op 'fast_norm'"):
        kernelize(model, {"LlamaRMSNorm": "fast_norm"})
    assert get_kernel_report(model) is None
    with pytest.raises(ConfigurationError, match="no default kernel mapping"):
        kernelize(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    kernel, op, reason = select_kernel("rms_norm", torch.device("cpu"))
    assert kernel is not None and op == "rms_norm" and reason is None


@pytest.mark.parametrize("shape", [(37, 24), (2, 3, 5, 16), (4, 1)])
def test_rms_norm_swiglu_and_rotary_kernels_equal_their_references(shape: tuple[int, ...]) -> None:
    from twinkle.kernel import TritonRMSNorm, TritonRotary, TritonSwiGLU, rotary_reference, swiglu_reference

    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(shape[-1], requires_grad=True)
    for kernel, reference, inputs in (
        (TritonRMSNorm(), rms_norm_reference, (x, weight, 1e-6)),
        (TritonSwiGLU(), swiglu_reference, (x, weight.expand_as(x))),
    ):
        grad = torch.randn(shape)
        fast = torch.autograd.grad((kernel(*inputs) * grad).sum(), [x, weight])
        slow = torch.autograd.grad((reference(*inputs) * grad).sum(), [x, weight])
        for a, b in zip(fast, slow, strict=True):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-6
    q = torch.randn(2, 5, 3, 8).transpose(1, 2).requires_grad_()  # [B, H, T, D] view, as attention passes it
    k = torch.randn(2, 1, 5, 8, requires_grad=True)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    fast_q, fast_k = TritonRotary()(q, k, cos, sin)
    slow_q, slow_k = rotary_reference(q, k, cos, sin)
    assert torch.allclose(fast_q, slow_q, atol=1e-6) and torch.allclose(fast_k, slow_k, atol=1e-6)
    grads = torch.autograd.grad((fast_q.sum() + 2 * fast_k.sum()), [q, k])
    slow_grads = torch.autograd.grad((slow_q.sum() + 2 * slow_k.sum()), [q, k])
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, slow_grads, strict=True))


def test_kernelized_multi_lora_layers_equal_the_per_adapter_loop() -> None:
    from twinkle.module import adapter_rows, inject_multi_lora, set_adapter_weights

    torch.manual_seed(2)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, **HEADS))
    names = inject_multi_lora(model, ["q_proj", "v_proj"])
    for adapter, rank in (("a", 3), ("b", 8)):
        tensors = {}
        for name in names:
            linear = model.get_submodule(name)
            A = torch.randn(rank, linear.in_features, requires_grad=True)
            tensors[name] = (A, torch.randn(linear.out_features, rank, requires_grad=True))
        set_adapter_weights(model, adapter, tensors, scaling=2.0)
    input_ids = torch.randint(0, 300, (3, 7))
    with adapter_rows(model, ["a", None, "b"]):
        expected = model(input_ids).logits
    report = kernelize(model, {"MultiLoraLinear": "multi_lora"})
    assert report.replaced == {"MultiLoraLinear": "TritonMultiLora"}
    with adapter_rows(model, ["a", None, "b"]):
        fast = model(input_ids).logits
    assert torch.allclose(fast, expected, rtol=1e-5, atol=1e-5)
    unkernelize(model)
    assert all(module.lora_kernel is None for module in model.modules() if hasattr(module, "lora_kernel"))
