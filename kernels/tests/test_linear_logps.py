"""The fused linear + label log-prob kernel against its reference: values, flags, entropy and every gradient.

Under pytest the Triton kernels run in the CPU interpreter. Run as a script
(``test_compiled_on_cuda`` does, in a fresh process) the same checks run with
compiled kernels on the GPU: Triton picks the interpreter when a kernel is
decorated, so it cannot be switched off inside a process that imported it.

Tolerances are relative to the largest expected value (at least 1). float32:
logits are dot products of H ≤ 128 terms and the log-sum-exp sums ≤ 1200
tiles in sequence, each rounding by 2^-24, so ≤ 1e-4 holds for any summation
order. bfloat16: values are as exact as in float32 (bf16 products are exact,
sums are float32); gradients go through bf16 gradient logits and bf16 matmul
outputs (2^-8 each), hence 3e-2.
"""

import os

os.environ["TRITON_INTERPRET"] = "0" if __name__ == "__main__" else "1"  # before any Triton kernel is decorated

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")


from twinkle.kernel.linear_logps import LinearLogps, TritonLinearLogps, linear_logps_reference

FP32_TOL = 1e-4
BF16_GRAD_TOL = 3e-2

Leaves = list[torch.Tensor]  # hidden, weight, then u, B of each term


def _problem(
    n_rows: int,
    n_hidden: int,
    n_vocab: int,
    terms: list[tuple[torch.Tensor | None, int]],
    seed: int = 0,
) -> tuple[Leaves, torch.Tensor, list[torch.Tensor | None]]:
    """float32 leaves on CPU for ``terms`` of ``(positions, rank)``, and labels: some ignored, some the argmax."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    hidden_NH = randn(n_rows, n_hidden)
    weight_VH = randn(n_vocab, n_hidden, scale=3 / n_hidden**0.5)  # logits of std 3: peaked, not one-hot
    leaves = [hidden_NH, weight_VH]
    for positions, rank in terms:
        leaves += [randn(n_rows if positions is None else len(positions), rank), randn(n_vocab, rank, scale=0.5)]
    labels_N = torch.randint(0, n_vocab, (n_rows,), generator=generator)
    # Every third row's label is its argmax without the terms, so `correct` has both values.
    labels_N[::3] = (hidden_NH @ weight_VH.T).argmax(-1)[::3]
    labels_N[1::7] = -100
    labels_N[-1:] = -100  # the last row: in the masked tail of its block
    return leaves, labels_N, [positions for positions, _ in terms]


def _run(
    kernel: Callable[..., Any],
    leaves: Leaves,
    labels_N: torch.Tensor,
    positions: list[torch.Tensor | None],
    with_entropy: bool,
    **kwargs: int,
) -> tuple[LinearLogps, list[torch.Tensor | None]]:
    """Outputs and the gradients of the leaves that need one, of ``Σ a·logps + Σ b·entropy`` for fixed random a, b."""
    hidden_NH, weight_VH, *factors = leaves
    low_rank = [(p, u, B) for p, u, B in zip(positions, factors[0::2], factors[1::2], strict=True)]
    output = kernel(hidden_NH, weight_VH, labels_N, low_rank, with_entropy, **kwargs)
    generator = torch.Generator().manual_seed(1)
    a_N, b_N = (torch.randn(len(labels_N), generator=generator).to(hidden_NH.device) for _ in range(2))
    loss = (output.logps * a_N.to(output.logps.dtype)).sum()
    if with_entropy:
        loss = loss + (output.entropy * b_N.to(output.entropy.dtype)).sum()
    needing = [leaf for leaf in leaves if leaf.requires_grad]
    grads = iter(torch.autograd.grad(loss, needing))
    return output, [next(grads) if leaf.requires_grad else None for leaf in leaves]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    error = (actual.double() - expected).abs().max().item() if expected.numel() else 0.0
    assert error <= tol * scale, f"{what}: max error {error:.3g} > {tol} × {scale:.3g}"


def _check(
    leaves: Leaves,
    labels_N: torch.Tensor,
    positions: list[torch.Tensor | None],
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    with_entropy: bool = True,
    needs_grad: tuple[bool, ...] | None = None,
    **kwargs: int,
) -> None:
    """The kernel on ``leaves`` in ``dtype`` against the reference on the same values in float64."""
    needs = needs_grad or (True,) * len(leaves)
    fast_leaves = [t.to(device, dtype).requires_grad_(n) for t, n in zip(leaves, needs, strict=True)]
    ref_leaves = [t.detach().double().requires_grad_(n) for t, n in zip(fast_leaves, needs, strict=True)]
    labels_N, positions = labels_N.to(device), [None if p is None else p.to(device) for p in positions]
    output, grads = _run(TritonLinearLogps().fast, fast_leaves, labels_N, positions, with_entropy, **kwargs)
    expected, expected_grads = _run(linear_logps_reference, ref_leaves, labels_N, positions, with_entropy)
    assert output.logps.dtype == torch.float32 and output.correct.dtype == torch.bool
    _assert_close(output.logps, expected.logps, FP32_TOL, "logps")
    assert torch.equal(output.correct, expected.correct)
    assert (output.logps[labels_N == -100] == 0).all()
    if with_entropy:
        assert output.entropy is not None and expected.entropy is not None
        _assert_close(output.entropy, expected.entropy, FP32_TOL, "entropy")
    grad_tol = FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    names = ["hidden", "weight"] + [f"{name}{i}" for i in range(len(positions)) for name in ("u", "B")]
    for name, grad, expected_grad in zip(names, grads, expected_grads, strict=True):
        assert (grad is None) == (expected_grad is None), name
        if grad is not None and expected_grad is not None:
            assert grad.dtype == dtype, name
            _assert_close(grad, expected_grad, grad_tol, f"grad {name}")


def _two_terms(n_rows: int) -> list[tuple[torch.Tensor | None, int]]:
    """Ranks 1 and 5 on different, overlapping row subsets; some rows in neither."""
    return [(torch.arange(0, n_rows, 3), 1), (torch.cat([torch.arange(10, 20), torch.arange(30, n_rows - 3)]), 5)]


@pytest.fixture
def narrow_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Vocabulary tiles of 256 in the interpreter, so a vocabulary of 1003 spans several tiles and a masked tail."""
    from twinkle.kernel.triton import linear_logps as triton_module

    monkeypatch.setattr(triton_module, "BLOCK_V_INTERPRETED", 256)


@pytest.mark.usefixtures("narrow_tiles")
@pytest.mark.parametrize("with_entropy", [False, True])
def test_matches_reference_with_two_terms(with_entropy: bool) -> None:
    leaves, labels_N, positions = _problem(37, 24, 1003, _two_terms(37))
    # Chunks of 16 tokens × 300 vocabulary entries: the backward's chunks have tails in both directions.
    _check(leaves, labels_N, positions, with_entropy=with_entropy, chunk_size=16, vocab_chunk_size=300)


@pytest.mark.usefixtures("narrow_tiles")
def test_frozen_base_gets_only_the_terms_gradients() -> None:
    """LoRA training: hidden and weight need no gradient; a term over every row and one over a few."""
    leaves, labels_N, positions = _problem(37, 24, 1003, [(None, 3), (torch.tensor([4, 5, 36]), 2)], seed=2)
    _check(leaves, labels_N, positions, needs_grad=(False, False, True, True, True, True))


@pytest.mark.usefixtures("narrow_tiles")
def test_gradient_of_the_entropy_alone() -> None:
    leaves, labels_N, positions = _problem(37, 24, 1003, _two_terms(37), seed=9)
    fast_leaves = [leaf.clone().requires_grad_() for leaf in leaves]
    ref_leaves = [leaf.double().requires_grad_() for leaf in leaves]
    grads = []
    for kernel, inputs in ((TritonLinearLogps().fast, fast_leaves), (linear_logps_reference, ref_leaves)):
        hidden_NH, weight_VH, u0, B0, u1, B1 = inputs
        output = kernel(hidden_NH, weight_VH, labels_N, [(positions[0], u0, B0), (positions[1], u1, B1)], True)
        grads.append(torch.autograd.grad(output.entropy.sum(), inputs))
    for grad, expected in zip(*grads, strict=True):
        _assert_close(grad, expected, FP32_TOL, "grad")


def test_without_terms_in_bfloat16() -> None:
    leaves, labels_N, positions = _problem(37, 24, 1003, [], seed=3)
    _check(leaves, labels_N, positions, dtype=torch.bfloat16)


def test_bfloat16_terms() -> None:
    leaves, labels_N, positions = _problem(37, 24, 1003, _two_terms(37), seed=4)
    _check(leaves, labels_N, positions, dtype=torch.bfloat16, chunk_size=16, vocab_chunk_size=300)


def test_qwen_sized_vocabulary() -> None:
    """V = 151,936: many vocabulary tiles and chunks (the last of each partial), entropy included."""
    leaves, labels_N, positions = _problem(8, 16, 151_936, [], seed=5)
    _check(leaves, labels_N, positions)


def test_no_rows() -> None:
    leaves, labels_N, positions = _problem(0, 16, 100, [(None, 2)])
    _check(leaves, labels_N, positions)


def test_matches_chunked_token_logps() -> None:
    """The same values and gradients as the model's CPU path, twinkle.module.chunked_token_logps."""
    module = pytest.importorskip("twinkle.module")
    leaves, labels_N, positions = _problem(37, 24, 1003, _two_terms(37), seed=6)
    leaves = [leaf.requires_grad_() for leaf in leaves]

    def chunked(
        hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor, low_rank: Any, _: bool
    ) -> Any:
        terms = [module.LowRankTerm(*term) for term in low_rank]
        return module.chunked_token_logps(hidden_NH, weight_VH, labels_N, chunk_size=8, low_rank=terms)

    output, grads = _run(TritonLinearLogps(), leaves, labels_N, positions, False)
    expected, expected_grads = _run(chunked, leaves, labels_N, positions, False)
    _assert_close(output.logps, expected.logps.double(), FP32_TOL, "logps")
    assert torch.equal(output.correct, expected.correct)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert grad is not None and expected_grad is not None
        _assert_close(grad, expected_grad.double(), FP32_TOL, "grad")


def test_float64_runs_the_reference() -> None:
    leaves, labels_N, _ = _problem(5, 16, 50, [(None, 2)])
    hidden_NH, weight_VH, u_NR, B_VR = (leaf.double() for leaf in leaves)
    output = TritonLinearLogps()(hidden_NH, weight_VH, labels_N, [(None, u_NR, B_VR)], with_entropy=True)
    expected = linear_logps_reference(hidden_NH, weight_VH, labels_N, [(None, u_NR, B_VR)], with_entropy=True)
    assert output.logps.dtype == torch.float64
    assert torch.equal(output.logps, expected.logps) and torch.equal(output.entropy, expected.entropy)


def test_availability() -> None:
    kernel = TritonLinearLogps()
    assert (kernel.op, kernel.backend) == ("linear_logps", "triton")
    assert kernel.unavailable_reason(torch.device("cpu")) is None  # the interpreter
    reason = kernel.unavailable_reason(torch.device("meta"))
    assert isinstance(reason, str) and "meta" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_on_cuda(run_compiled: Callable[[str], None]) -> None:
    """The checks above with compiled kernels on the GPU, and the backward's memory bound (see _check_cuda)."""
    run_compiled(__file__)


def _check_cuda() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        leaves, labels_N, positions = _problem(300, 128, 32_003, _two_terms(300), seed=7)
        _check(leaves, labels_N, positions, device="cuda", dtype=dtype, chunk_size=128, vocab_chunk_size=5000)
    leaves, labels_N, positions = _problem(300, 128, 151_936, [], seed=8)
    _check(leaves, labels_N, positions, device="cuda")
    # Peak memory beyond the inputs and their gradients stays far below the [N, V] float32 logits.
    n_rows, n_hidden, n_vocab = 8192, 256, 151_936
    hidden_NH = torch.randn(n_rows, n_hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight_VH = torch.randn(n_vocab, n_hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels_N = torch.randint(0, n_vocab, (n_rows,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    TritonLinearLogps()(hidden_NH, weight_VH, labels_N).logps.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - baseline
    assert extra < n_rows * n_vocab * 4 / 8, f"peak {extra / 2**20:.0f} MiB"
    print("compiled kernels on CUDA match the reference")


if __name__ == "__main__":
    _check_cuda()
