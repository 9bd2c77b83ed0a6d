"""``kernelize`` on the shipped families: same logits and gradients, and an exact undo."""

from __future__ import annotations

from collections.abc import Callable

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
    _check_family(model, torch.float32)


def _check_family(model: torch.nn.Module, dtype: torch.dtype) -> None:
    # fp32 kernels against the same fp32 model: rounding differs in the order of a few ulps per layer; in
    # bfloat16 a ulp of difference in one layer's output grows through the next ones.
    logits_tolerance, grad_tolerance = (1e-5, 1e-4) if dtype == torch.float32 else (2.0**-4, 2.0**-3)
    input_ids = torch.randint(0, 300, (2, 9), device=next(model.parameters()).device)
    logits, grads = _logits_and_grads(model, input_ids)
    attributes = {name: dict(module.__dict__) for name, module in model.named_modules()}
    report = kernelize(model)
    assert {"rms_norm", "swiglu", "rotary"} <= {e.op for e in report.entries if e.kernel}, str(report)
    assert report.kernels[OUTPUT_LOGPS].op == "linear_logps"
    assert get_kernel_report(model) is report
    kernel_logits, kernel_grads = _logits_and_grads(model, input_ids)
    assert (kernel_logits - logits).abs().max() <= logits_tolerance * (logits.abs().max() + 1)
    for name, grad in grads.items():
        assert (kernel_grads[name] - grad).abs().max() <= grad_tolerance * grad.abs().max() + 1e-7, name
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


# Tolerances relative to the reference's largest magnitude: fp32 kernels differ from PyTorch by a few ulps of
# reassociated sums; in half precision each side rounds its output (and PyTorch the normalised input) once more.
RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8}


def _close(fast: torch.Tensor, slow: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool((fast.float() - slow.float()).abs().max() <= RELATIVE[dtype] * slow.float().abs().max() + 1e-6)


def _check_elementwise(shape: tuple[int, ...], device: str, dtype: torch.dtype) -> None:
    """RMSNorm and SwiGLU over ``shape``, outputs and gradients against the references on the same inputs."""
    from twinkle.kernel import TritonRMSNorm, TritonSwiGLU, swiglu_reference

    generator = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()
    weight = torch.randn(shape[-1], generator=generator).to(device, dtype).requires_grad_()
    for kernel, reference, inputs in (
        (TritonRMSNorm(), rms_norm_reference, (x, weight, 1e-6)),
        (TritonSwiGLU(), swiglu_reference, (x, weight.expand_as(x))),
    ):
        grad = torch.randn(shape, generator=generator).to(device, dtype)
        fast_out, slow_out = kernel(*inputs), reference(*inputs)
        assert _close(fast_out, slow_out, dtype), (kernel, shape, dtype)
        fast = torch.autograd.grad((fast_out * grad).sum(), [x, weight])
        slow = torch.autograd.grad((slow_out * grad).sum(), [x, weight])
        for a, b in zip(fast, slow, strict=True):
            assert _close(a, b, dtype), (kernel, shape, dtype)


def _check_rotary(q_shape: tuple[int, int, int, int], kv_heads: int, device: str, dtype: torch.dtype) -> None:
    """Rotary embedding of a ``[B, H, T, D]`` query (a transposed view, as attention passes it) and its keys."""
    from twinkle.kernel import TritonRotary, rotary_reference

    batch, heads, tokens, dim = q_shape
    generator = torch.Generator().manual_seed(tokens * dim)

    def tensor(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(device, dtype)

    q = tensor(batch, tokens, heads, dim).transpose(1, 2).requires_grad_()
    k = tensor(batch, kv_heads, tokens, dim).requires_grad_()
    cos, sin = tensor(batch, tokens, dim), tensor(batch, tokens, dim)
    fast_q, fast_k = TritonRotary()(q, k, cos, sin)
    slow_q, slow_k = rotary_reference(q, k, cos, sin)
    assert _close(fast_q, slow_q, dtype) and _close(fast_k, slow_k, dtype), (q_shape, dtype)
    grads = torch.autograd.grad(fast_q.sum() + 2 * fast_k.sum(), [q, k])
    slow_grads = torch.autograd.grad(slow_q.sum() + 2 * slow_k.sum(), [q, k])
    assert all(_close(a, b, dtype) for a, b in zip(grads, slow_grads, strict=True)), (q_shape, dtype)


@pytest.mark.parametrize("shape", [(37, 24), (2, 3, 5, 16), (4, 1)])
def test_rms_norm_swiglu_and_rotary_kernels_equal_their_references(shape: tuple[int, ...]) -> None:
    _check_elementwise(shape, "cpu", torch.float32)
    _check_rotary((2, 3, 5, 8), 1, "cpu", torch.float32)


def test_kernelized_multi_lora_layers_equal_the_per_adapter_loop() -> None:
    _check_multi_lora_layers("cpu")


def _check_multi_lora_layers(device: str) -> None:
    from twinkle.module import adapter_rows, inject_multi_lora, set_adapter_weights

    torch.manual_seed(2)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, **HEADS)).to(device)
    names = inject_multi_lora(model, ["q_proj", "v_proj"])
    for adapter, rank in (("a", 3), ("b", 8)):
        tensors = {}
        for name in names:
            linear = model.get_submodule(name)
            A = torch.randn(rank, linear.in_features, device=device, requires_grad=True)
            tensors[name] = (A, torch.randn(linear.out_features, rank, device=device, requires_grad=True))
        set_adapter_weights(model, adapter, tensors, scaling=2.0)
    input_ids = torch.randint(0, 300, (3, 7), device=device)
    with adapter_rows(model, ["a", None, "b"]):
        expected = model(input_ids).logits
    report = kernelize(model, {"MultiLoraLinear": "multi_lora"})
    assert report.replaced == {"MultiLoraLinear": "TritonMultiLora"}
    with adapter_rows(model, ["a", None, "b"]):
        fast = model(input_ids).logits
    assert torch.allclose(fast, expected, rtol=1e-5, atol=1e-5)
    unkernelize(model)
    assert all(module.lora_kernel is None for module in model.modules() if hasattr(module, "lora_kernel"))


def _check_on_cuda() -> None:
    """The checks above with kernels compiled for the GPU, in float32 and bfloat16, at sizes real models use."""
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((37, 24), (2, 3, 5, 16), (4, 1), (3, 7, 151), (1025, 4096)):
            _check_elementwise(shape, "cuda", dtype)
        for q_shape, kv_heads in (((2, 3, 5, 8), 1), ((1, 16, 513, 128), 8)):  # Qwen3-8B's heads on the second
            _check_rotary(q_shape, kv_heads, "cuda", dtype)
        for model in _models():
            _check_family(model.to("cuda", dtype), dtype)
    _check_multi_lora_layers("cuda")
    print("compiled kernels on CUDA match the references")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_on_cuda(run_compiled: Callable[[str], None]) -> None:
    run_compiled(__file__)


if __name__ == "__main__":
    _check_on_cuda()
