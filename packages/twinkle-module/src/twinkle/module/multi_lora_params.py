"""Per-row LoRA on parameters that are not ``nn.Linear`` layers: a MoE layer's fused experts and its router.

PEFT adapts such parameters through ``LoraConfig(target_parameters=[...])``
(and its ``"all-linear"`` adds them on transformers' MoE families): a 3-D
fused expert tensor ``[E, out, in]`` gets one rank-``r`` pair per expert, a
2-D router weight ``[E, hidden]`` one pair like a linear layer. PEFT folds the
update into the weight, which serves one adapter per forward. Here each batch
row gets its own adapter, as :class:`~twinkle.module.MultiLoraLinear` does for
linear layers:

- :class:`MultiLoraExperts` runs the experts with every (token, expert)
  pair's low-rank updates added on the rows of that token's adapter, never
  materialising an adapted copy of the experts;
- :class:`MultiLoraRouter` runs a token-wise module (a router) once per group
  of tokens that share an adapter, with that adapter's small weight
  ``W + scaling·B·A`` in place of ``W``.

Both keep the wrapped module's parameters, buffers and children under their
own names (the model's ``state_dict()`` keys do not change) and call the
wrapped module's own forward when no row has an adapter on them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from twinkle.errors import ConfigurationError, InvalidInputError

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


@dataclass
class ExpertLora:
    """One adapter on one fused expert tensor ``[E, out, in]``: expert ``e`` adds ``x @ A_ERI[e].T @ B_EOR[e].T · s``.

    PEFT stores the pair as ``lora_A [r·E, in]`` (experts major) and ``lora_B [out, r·E]``
    (experts minor); :meth:`from_peft` takes views of those tensors, so gradients reach them.
    """

    A_ERI: torch.Tensor
    B_EOR: torch.Tensor
    scaling: float

    @classmethod
    def from_peft(cls, A_SI: torch.Tensor, B_OS: torch.Tensor, num_experts: int, scaling: float) -> ExpertLora:
        rank = A_SI.shape[0] // num_experts
        A_ERI = A_SI.view(num_experts, rank, A_SI.shape[1])
        B_EOR = B_OS.view(B_OS.shape[0], rank, num_experts).permute(2, 0, 1)
        return cls(A_ERI, B_EOR, float(scaling))

    def delta_weight(self) -> torch.Tensor:
        """The update of the whole tensor, ``[E, out, in]`` (for merging, not for the forward)."""
        return torch.bmm(self.B_EOR, self.A_ERI) * self.scaling


@dataclass
class RouterLora:
    """One adapter on a 2-D weight ``[out, in]`` of a token-wise module: ``W + scaling · B_OR @ A_RI``."""

    A_RI: torch.Tensor
    B_OR: torch.Tensor
    scaling: float

    def delta_weight(self) -> torch.Tensor:
        return self.B_OR @ self.A_RI * self.scaling


ParameterLora = ExpertLora | RouterLora


def is_fused_experts(module: nn.Module) -> bool:
    """A MoE layer's experts kept as fused ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` tensors."""
    params = dict(module.named_parameters(recurse=False))
    return set(EXPERT_PARAMETERS) <= set(params) and params["gate_up_proj"].dim() == 3


class _AdaptedParameters(nn.Module, ABC):
    """Takes over ``base``'s parameters, buffers, children and plain attributes under their own names."""

    base: nn.Module

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        for name, child in base.named_children():
            self.add_module(name, child)
        for name, param in base.named_parameters(recurse=False):
            self.register_parameter(name, param)
        non_persistent: set[str] = getattr(base, "_non_persistent_buffers_set", set())
        for name, buffer in base.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in non_persistent)
        for name, value in vars(base).items():
            if not name.startswith("_") and name != "training":
                setattr(self, name, value)
        # Not a submodule (its tensors are registered above, once): called for batches no adapter here touches.
        object.__setattr__(self, "base", base)
        self.adapters: dict[str, dict[str, Any]] = {}  # adapter -> parameter name -> its LoRA pair
        self.routing: Any = None  # twinkle.module.RowRouting, set by adapter_rows

    def token_groups(self, tokens: int) -> list[tuple[torch.Tensor | None, dict[str, Any]]]:
        """The adapters of this layer in the current :func:`adapter_rows` block, each with its tokens (``None``: all).

        The layer runs on the batch's flattened tokens (``batch_size × tokens_per_row``).
        """
        if self.routing is None:
            return []
        batch = self.routing.batch_size
        if tokens % batch:
            raise InvalidInputError(
                f"adapter_rows assigned {batch} rows but a MoE layer got {tokens} tokens, not a whole number per row"
            )
        device = next(iter(self.parameters())).device
        rows_N = torch.arange(tokens, device=device) // (tokens // batch)
        return [
            (token_ids, self.adapters[name])
            for name, token_ids in self.routing.for_tokens(rows_N).groups
            if name in self.adapters
        ]

    @abstractmethod
    def checked_weights(self, name: str, param: str, A: torch.Tensor, B: torch.Tensor, scaling: float) -> Any:
        """Adapter ``name``'s pair on ``param`` in PEFT's layout, validated and moved to the weight's device."""

    def extra_repr(self) -> str:
        return f"{type(self.base).__name__}, adapters={sorted(self.adapters)}"


class MultiLoraExperts(_AdaptedParameters):
    """Fused experts with per-row LoRA adapters on ``gate_up_proj`` and/or ``down_proj``."""

    act_fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, base: nn.Module) -> None:
        if not is_fused_experts(base) or getattr(base, "is_transposed", False) or getattr(base, "has_bias", False):
            raise ConfigurationError(
                f"LoRA on experts needs fused gate_up_proj [E, 2I, H] and down_proj [E, H, I] without biases; "
                f"{type(base).__name__} has other tensors"
            )
        super().__init__(base)
        self.num_experts = int(base.get_parameter("gate_up_proj").shape[0])

    def checked_weights(self, name: str, param: str, A_SI: torch.Tensor, B_OS: torch.Tensor, scaling: float) -> Any:
        weight = self.get_parameter(param)
        experts, out_features, in_features = weight.shape
        a_ok = A_SI.dim() == 2 and A_SI.shape[1] == in_features and A_SI.shape[0] % experts == 0
        if not a_ok or tuple(B_OS.shape) != (out_features, A_SI.shape[0]):
            raise InvalidInputError(
                f"adapter {name!r}: LoRA on {param} ({experts} experts) needs A [rank·{experts}, {in_features}] and "
                f"B [{out_features}, rank·{experts}], got A {list(A_SI.shape)} and B {list(B_OS.shape)}"
            )
        A_SI, B_OS = A_SI.to(weight.device, weight.dtype), B_OS.to(weight.device, weight.dtype)
        return ExpertLora.from_peft(A_SI, B_OS, experts, scaling)

    def forward(self, hidden_NH: torch.Tensor, top_k_index_NK: torch.Tensor, top_k_weights_NK: torch.Tensor) -> Any:
        groups = self.token_groups(hidden_NH.shape[0])
        if not groups:
            return self.base(hidden_NH, top_k_index_NK, top_k_weights_NK)
        adapter_N = torch.full((hidden_NH.shape[0],), -1, dtype=torch.long, device=hidden_NH.device)
        for index, (tokens, _) in enumerate(groups):
            adapter_N[slice(None) if tokens is None else tokens] = index
        loras = [adapter for _, adapter in groups]
        output_NH = torch.zeros_like(hidden_NH)
        for expert in torch.unique(top_k_index_NK).tolist():
            if expert >= self.num_experts:  # a router's "no expert"
                continue
            tokens_T, slots_T = torch.where(top_k_index_NK == expert)
            x_TH, adapter_T = hidden_NH[tokens_T], adapter_N[tokens_T]
            gate_up = self._linear(x_TH, "gate_up_proj", expert, adapter_T, loras)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden_TI = self.act_fn(gate) * up
            out_TH = self._linear(hidden_TI, "down_proj", expert, adapter_T, loras)
            out_TH = out_TH * top_k_weights_NK[tokens_T, slots_T, None]
            output_NH.index_add_(0, tokens_T, out_TH.to(output_NH.dtype))
        return output_NH

    def _linear(
        self, x_TI: torch.Tensor, param: str, expert: int, adapter_T: torch.Tensor, loras: list[dict[str, Any]]
    ) -> torch.Tensor:
        """Expert ``expert``'s projection ``param`` of its tokens, each with its adapter's update (in place)."""
        out = nn.functional.linear(x_TI, self.get_parameter(param)[expert])
        for index in torch.unique(adapter_T).tolist():
            lora = loras[index].get(param) if index >= 0 else None
            if lora is None:
                continue
            rows = (adapter_T == index).nonzero(as_tuple=True)[0]
            delta = x_TI[rows] @ lora.A_ERI[expert].T @ lora.B_EOR[expert].T * lora.scaling
            out.index_add_(0, rows, delta)
        return out


class MultiLoraRouter(_AdaptedParameters):
    """A token-wise module (a MoE router) whose 2-D weights carry per-row LoRA adapters.

    The module is run once per group of tokens sharing an adapter, with that
    adapter's ``W + scaling·B·A``; every output is a tensor (or tuple of
    tensors) with one row per token, put back in token order.
    """

    def checked_weights(self, name: str, param: str, A_RI: torch.Tensor, B_OR: torch.Tensor, scaling: float) -> Any:
        weight = self.get_parameter(param)
        if weight.dim() != 2:
            raise ConfigurationError(f"adapter {name!r}: LoRA on {param} {list(weight.shape)} is not supported")
        out_features, in_features = weight.shape
        if A_RI.dim() != 2 or A_RI.shape[1] != in_features or tuple(B_OR.shape) != (out_features, A_RI.shape[0]):
            raise InvalidInputError(
                f"adapter {name!r}: LoRA on {param} needs A [rank, {in_features}] and B [{out_features}, rank], "
                f"got A {list(A_RI.shape)} and B {list(B_OR.shape)}"
            )
        return RouterLora(A_RI.to(weight.device, weight.dtype), B_OR.to(weight.device, weight.dtype), float(scaling))

    def forward(self, hidden_NH: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tokens = hidden_NH.reshape(-1, hidden_NH.shape[-1]).shape[0]
        groups = self.token_groups(tokens)
        if not groups:
            return self.base(hidden_NH, *args, **kwargs)
        hidden_NH = hidden_NH.reshape(tokens, hidden_NH.shape[-1])
        adapted = torch.zeros(tokens, dtype=torch.bool, device=hidden_NH.device)
        parts: list[tuple[torch.Tensor | None, Any]] = []
        for token_ids, adapter in groups:
            weights = {param: self.get_parameter(param) + lora.delta_weight() for param, lora in adapter.items()}
            x = hidden_NH if token_ids is None else hidden_NH[token_ids]
            parts.append((token_ids, torch.func.functional_call(self.base, weights, (x, *args), kwargs)))
            adapted[slice(None) if token_ids is None else token_ids] = True
        if not adapted.all():
            plain = (~adapted).nonzero(as_tuple=True)[0]
            parts.append((plain, self.base(hidden_NH[plain], *args, **kwargs)))
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        return _scatter_outputs(parts, tokens)


def _scatter_outputs(parts: list[tuple[torch.Tensor | None, Any]], tokens: int) -> Any:
    """Each group's outputs (a tensor or a tuple of them, a row per token) put together in token order."""
    first = parts[0][1]
    single = isinstance(first, torch.Tensor)
    outputs: list[torch.Tensor] = []
    for position in range(1 if single else len(first)):
        pieces = [(ids, output if single else output[position]) for ids, output in parts]
        sample = pieces[0][1]
        whole = sample.new_zeros((tokens, *sample.shape[1:]))
        for ids, piece in pieces:
            whole = whole.index_copy(0, ids, piece) if ids is not None else piece
        outputs.append(whole)
    return outputs[0] if single else type(first)(outputs)


def parameter_lora_layer(owner: nn.Module, param: str) -> type[_AdaptedParameters]:
    """The wrapper that serves LoRA on ``owner``'s parameter ``param``, or a clear refusal."""
    if is_fused_experts(owner):
        if param not in EXPERT_PARAMETERS:
            raise ConfigurationError(f"LoRA on experts adapts {' and '.join(EXPERT_PARAMETERS)}, not {param!r}")
        return MultiLoraExperts
    weight = owner.get_parameter(param)
    if weight.dim() != 2:
        raise ConfigurationError(
            f"LoRA on the {weight.dim()}-D parameter {param!r} of {type(owner).__name__} is not supported: "
            "target fused MoE experts (3-D) or a router's 2-D weight"
        )
    return MultiLoraRouter


def parameter_lora_modules(model: nn.Module) -> Iterator[tuple[str, _AdaptedParameters]]:
    """Every :class:`MultiLoraExperts` / :class:`MultiLoraRouter` of ``model`` with its name."""
    for name, module in model.named_modules():
        if isinstance(module, _AdaptedParameters):
            yield name, module
