"""Grouped matmul: every expert's tokens times that expert's weight, for mixture-of-experts layers.

Tokens arrive sorted by expert, ``tokens_per_expert_E[e]`` rows for expert
``e`` (0 allowed), so ``y[rows of e] = x[rows of e] @ weight_EKN[e]``. The
reference loops over the experts with torch matmuls; on Ascend NPUs torch-npu's
``npu_grouped_matmul`` runs every group in one op.
"""

from __future__ import annotations

import torch

from twinkle.errors import InvalidInputError
from twinkle.interfaces import Kernel
from twinkle.kernel.backends import npu_unavailable_reason
from twinkle.registry import register

__all__ = ["NpuGroupedMatmul", "check_groups", "grouped_matmul_reference"]


def check_groups(x_TK: torch.Tensor, weight_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> None:
    """Shapes that fit: ``x [T, K]``, ``weight [E, K, N]``, ``E`` non-negative counts summing to ``T``."""
    if x_TK.dim() != 2 or weight_EKN.dim() != 3 or x_TK.shape[1] != weight_EKN.shape[1]:
        raise InvalidInputError(
            f"grouped matmul takes x [T, K] and weight [E, K, N], got {tuple(x_TK.shape)} and {tuple(weight_EKN.shape)}"
        )
    counts = tokens_per_expert_E
    if counts.dim() != 1 or counts.shape[0] != weight_EKN.shape[0] or counts.dtype.is_floating_point:
        raise InvalidInputError(
            f"tokens_per_expert must be {weight_EKN.shape[0]} integer counts (one per expert), "
            f"got {counts.dtype} of shape {tuple(counts.shape)}"
        )
    if bool((counts < 0).any()) or int(counts.sum()) != x_TK.shape[0]:
        raise InvalidInputError(
            f"tokens_per_expert must be >= 0 and sum to the {x_TK.shape[0]} tokens, got {counts.tolist()}"
        )


def grouped_matmul_reference(
    x_TK: torch.Tensor, weight_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor
) -> torch.Tensor:
    check_groups(x_TK, weight_EKN, tokens_per_expert_E)
    groups = x_TK.split(tokens_per_expert_E.tolist())
    outputs = [x_gK @ weight_EKN[expert] for expert, x_gK in enumerate(groups)]
    return torch.cat(outputs) if outputs else x_TK.new_zeros(0, weight_EKN.shape[2])


@register("kernel")
class NpuGroupedMatmul(Kernel):
    """torch-npu's ``npu_grouped_matmul`` with one ``x`` split by counts and one stacked ``[E, K, N]`` weight."""

    op = "grouped_matmul"
    backend = "npu"

    def unavailable_reason(self, device: object) -> str | None:
        return npu_unavailable_reason(device)

    def reference(
        self, x_TK: torch.Tensor, weight_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> torch.Tensor:
        return grouped_matmul_reference(x_TK, weight_EKN, tokens_per_expert_E)

    def fast(self, x_TK: torch.Tensor, weight_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        import torch_npu

        check_groups(x_TK, weight_EKN, tokens_per_expert_E)
        # split_item=2: one output tensor; group_type=0: groups along the tokens; group_list_type=1: counts.
        outputs = torch_npu.npu_grouped_matmul(
            [x_TK],
            [weight_EKN],
            group_list=tokens_per_expert_E.to(device=x_TK.device, dtype=torch.int64),
            split_item=2,
            group_type=0,
            group_list_type=1,
        )
        output: torch.Tensor = outputs[0]
        return output
