"""The grouped matmul of mixture-of-experts layers: each token times its expert's weight, with gradients."""

from __future__ import annotations

import pytest
import torch

from twinkle.errors import InvalidInputError
from twinkle.kernel import NpuGroupedMatmul, grouped_matmul_reference


def _per_token(x_TK: torch.Tensor, weight_EKN: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Independent definition: token t's row times the weight of the expert it belongs to."""
    experts_T = torch.repeat_interleave(torch.arange(len(counts_E)), counts_E)
    return torch.bmm(x_TK.unsqueeze(1), weight_EKN[experts_T]).squeeze(1)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 9], [0, 0, 0, 0]])
def test_each_expert_multiplies_its_own_tokens_with_gradients(counts: list[int]) -> None:
    torch.manual_seed(0)
    counts_E = torch.tensor(counts)
    x_TK = torch.randn(int(counts_E.sum()), 6, dtype=torch.float64, requires_grad=True)
    weight_EKN = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)
    output = NpuGroupedMatmul()(x_TK, weight_EKN, counts_E)  # falls back to the reference off an NPU
    expected = _per_token(x_TK, weight_EKN, counts_E)
    assert output.shape == (int(counts_E.sum()), 5)
    assert torch.allclose(output, expected, atol=1e-12)
    if output.numel():
        grad = torch.randn_like(output)
        ours = torch.autograd.grad((output * grad).sum(), [x_TK, weight_EKN])
        theirs = torch.autograd.grad((expected * grad).sum(), [x_TK, weight_EKN])
        for a, b in zip(ours, theirs, strict=True):
            assert torch.allclose(a, b, atol=1e-12)


def test_groups_that_do_not_fit_are_refused_by_name() -> None:
    x_TK, weight_EKN = torch.zeros(4, 3), torch.zeros(2, 3, 5)
    with pytest.raises(InvalidInputError, match="sum to the 4 tokens"):
        grouped_matmul_reference(x_TK, weight_EKN, torch.tensor([1, 2]))
    with pytest.raises(InvalidInputError, match="2 integer counts"):
        grouped_matmul_reference(x_TK, weight_EKN, torch.tensor([4]))
    with pytest.raises(InvalidInputError, match="x \\[T, K\\] and weight \\[E, K, N\\]"):
        grouped_matmul_reference(x_TK, torch.zeros(2, 4, 5), torch.tensor([2, 2]))
    reason = NpuGroupedMatmul().unavailable_reason(torch.device("cpu"))
    assert reason is not None and "torch-npu" in reason
