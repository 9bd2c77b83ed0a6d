"""The Triton multi-LoRA kernel against its PyTorch reference: outputs and every gradient, within proven bounds.

Tolerances are not tuned to a machine: each is the worst-case rounding error of
the computation (Higham's ``gamma_n = n u / (1 - n u)`` times the same sums
taken over absolute values), which holds whatever order a BLAS, the
interpreter or a GPU sums in.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is decorated (also set in conftest.py)

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from twinkle.errors import InvalidInputError
from twinkle.kernel.multi_lora import LoraTriple, TritonMultiLora, multi_lora_delta_reference

pytest.importorskip("triton")

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

# (rows, in_features, out_features, ranks); every case also has rows with no adapter and one adapter with no rows.
MIXED = (37, 40, 52, [1, 7, 16, 33, 64])
LONG_SEGMENTS = (100, 70, 20, [8, 3, 5])  # segments of several row blocks, two steps over in_features
GPU_CASES = [(3001, 1000, 1500, [1, 8, 16, 33, 64]), (257, 4096, 4096, [16, 64])]


def _make(
    n_rows: int, in_features: int, out_features: int, ranks: Sequence[int], device: str, dtype: torch.dtype
) -> tuple[torch.Tensor, list[LoraTriple], torch.Tensor]:
    generator = torch.Generator().manual_seed(n_rows + in_features)
    x_NI = torch.randn(n_rows, in_features, generator=generator)
    loras = [
        (torch.randn(rank, in_features, generator=generator), torch.randn(out_features, rank, generator=generator), s)
        for rank, s in zip(ranks, [0.5, 2.0, 0.25, 1.0, 4.0], strict=False)
    ]
    # Interleaved and unsorted; adapter 1 gets no rows; adapter 0 gets most of them, so its segment is long.
    used = [a for a in range(-1, len(ranks)) if a != 1]
    weights = torch.tensor([3.0 if a == 0 else 1.0 for a in used])
    adapter_N = torch.tensor(used)[torch.multinomial(weights, n_rows, replacement=True, generator=generator)]
    adapter_N[:2] = torch.tensor([-1, 0])  # both kinds of rows present however the draw falls
    return (
        x_NI.to(device, dtype),
        [(A.to(device, dtype), B.to(device, dtype), s) for A, B, s in loras],
        adapter_N.to(device),
    )


def _delta_and_grads(
    x_NI: torch.Tensor, loras: Sequence[LoraTriple], adapter_N: torch.Tensor, grad_NO: torch.Tensor, fast: bool
) -> list[torch.Tensor]:
    """``[delta, grad_x, grad_A_0, grad_B_0, ...]`` of the kernel (``fast``) or the reference."""
    x_NI = x_NI.detach().requires_grad_()
    loras = [(A.detach().requires_grad_(), B.detach().requires_grad_(), s) for A, B, s in loras]
    kernel = TritonMultiLora()
    delta_NO = (kernel.fast if fast else kernel.reference)(x_NI, loras, adapter_N)
    grads = torch.autograd.grad(delta_NO, [x_NI, *(w for A, B, _ in loras for w in (A, B))], grad_NO)
    return [delta_NO.detach(), *grads]


def _check(
    n_rows: int, in_features: int, out_features: int, ranks: Sequence[int], device: str, dtype: torch.dtype
) -> None:
    x_NI, loras, adapter_N = _make(n_rows, in_features, out_features, ranks, device, dtype)
    grad_NO = torch.randn(n_rows, out_features, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    got = _delta_and_grads(x_NI, loras, adapter_N, grad_NO, fast=True)

    def wide(t: torch.Tensor, absolute: bool) -> torch.Tensor:
        return (t.abs() if absolute else t).to(torch.float64)

    expected = _delta_and_grads(
        wide(x_NI, False),
        [(wide(A, False), wide(B, False), s) for A, B, s in loras],
        adapter_N,
        wide(grad_NO, False),
        fast=False,
    )
    # The same products over absolute values bound every sum's rounding error (each result is multilinear).
    magnitudes = _delta_and_grads(
        wide(x_NI, True),
        [(wide(A, True), wide(B, True), abs(s)) for A, B, s in loras],
        adapter_N,
        wide(grad_NO, True),
        fast=False,
    )
    n = n_rows + in_features + out_features + max(ranks) + 4  # longer than any chain of sums, plus the roundings
    u32, u_low = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[dtype]
    gamma = n * u32 / (1 - n * u32)
    # Low precision rounds twice more: the result, and (on a GPU) y or grad_y before the second matmul.
    relative = gamma if dtype == torch.float32 else (1 + u_low) ** 2 * (1 + gamma) - 1
    names = ["delta", "grad_x"] + [f"grad_{w}{a}" for a in range(len(loras)) for w in "AB"]
    for name, value, reference, magnitude in zip(names, got, expected, magnitudes, strict=True):
        assert value.dtype == dtype and value.shape == reference.shape, name
        error = (value.to(torch.float64) - reference).abs()
        excess = (error - relative * magnitude).max().item()
        assert excess <= 0, f"{name}: error {error.max().item():.3g} exceeds its bound by {excess:.3g}"

    no_adapter_N = adapter_N == -1
    assert torch.equal(got[0][no_adapter_N], torch.zeros_like(got[0][no_adapter_N]))
    assert torch.equal(got[1][no_adapter_N], torch.zeros_like(got[1][no_adapter_N]))
    assert not got[4].any() and not got[5].any(), "adapter 1 has no rows: its gradients are exactly zero"


@pytest.mark.parametrize("case", [MIXED, LONG_SEGMENTS], ids=["mixed_ranks", "long_segments"])
def test_float32_matches_reference(case: tuple[int, int, int, list[int]]) -> None:
    _check(*case, device="cpu", dtype=torch.float32)


def test_bfloat16_matches_reference_on_the_same_values() -> None:
    _check(*MIXED, device="cpu", dtype=torch.bfloat16)


def test_rows_without_adapter_only_and_x_without_grad() -> None:
    x_NI, loras, _ = _make(*MIXED, device="cpu", dtype=torch.float32)
    loras = [(A.requires_grad_(), B.requires_grad_(), s) for A, B, s in loras]
    delta_NO = TritonMultiLora().fast(x_NI, loras, torch.full((x_NI.shape[0],), -1))
    assert torch.equal(delta_NO, torch.zeros_like(delta_NO))
    grads = torch.autograd.grad(delta_NO.sum(), [w for A, B, _ in loras for w in (A, B)])
    assert not any(grad.any() for grad in grads)


def test_blocks_never_straddle_segments_and_cover_every_row_once() -> None:
    from twinkle.kernel.triton.multi_lora import BLOCK_M, _Routing

    adapter_N = torch.tensor([2, -1, 0, 0, 2, 5, -7] * 20)  # 5 and -7 are no adapter, as in the reference
    routing = _Routing(adapter_N, n_adapters=3)
    segment_N = torch.where((adapter_N >= 0) & (adapter_N < 3), adapter_N, -1)
    seen_P = torch.zeros(adapter_N.numel(), dtype=torch.int64)
    for adapter, start, end in routing.blocks_3B.T.tolist():
        assert end - start <= BLOCK_M
        rows = routing.rows_P[start:end].long()
        assert (segment_N[rows] == adapter).all()
        seen_P[start:end] += 1
    assert (seen_P == 1).all()
    assert sorted(routing.rows_P.tolist()) == list(range(adapter_N.numel()))


def test_availability_and_dtypes() -> None:
    kernel = TritonMultiLora()
    assert kernel.unavailable_reason(torch.device("cpu")) is None  # under the interpreter
    assert "float64" in (kernel.unavailable_reason("cpu", torch.float64) or "")
    x_NI, loras, adapter_N = _make(5, 16, 16, [4], device="cpu", dtype=torch.float64)
    assert torch.equal(kernel(x_NI, loras, adapter_N), multi_lora_delta_reference(x_NI, loras, adapter_N))
    with pytest.raises(InvalidInputError, match="float64"):
        kernel.fast(x_NI, loras, adapter_N)
    with pytest.raises(InvalidInputError, match="at least one adapter"):
        kernel(x_NI, [], adapter_N)


def check_on_cuda() -> None:
    """The GPU cases in float32, bfloat16 and float16 (run by :func:`test_compiled_on_cuda` in a fresh process)."""
    for case in GPU_CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            _check(*case, device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_on_cuda() -> None:
    # This process decorated the kernels for the interpreter; a fresh one compiles them for the GPU.
    code = (
        f"import os, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_multi_lora as t; "
        "os.environ['TRITON_INTERPRET'] = '0'; t.check_on_cuda()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
