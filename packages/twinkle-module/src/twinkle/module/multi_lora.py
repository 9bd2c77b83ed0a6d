"""Many LoRA adapters on one frozen base model, chosen per batch row.

A multi-tenant sampler (and later trainer) serves several adapters from one
copy of the base weights: every row of a batch may use a different adapter, or
none. :class:`MultiLoraLinear` replaces an ``nn.Linear``; it computes the base
projection once for the whole batch and adds each adapter's low-rank update
only to the rows assigned to it (one gather, two skinny matmuls and one
``index_add`` per adapter present in the batch). Rows are assigned for a whole
model at once with :func:`adapter_rows`. A layer that runs on flattened tokens
instead of batch rows (an output layer applied to the supervised positions
only) is called through :func:`per_token`, which maps each token to its row,
or hands its updates to the chunked log-probs (:meth:`MultiLoraLinear.low_rank_terms`).

Adapters may differ in rank and target modules. Their tensors are *not*
registered as module parameters: the model's ``state_dict()`` keeps exactly the
base model's keys (``...q_proj.weight``), and the tensors belong to whoever set
them — a trainer may pass its own ``requires_grad`` tensors and gradients flow
to them through :meth:`MultiLoraLinear.forward`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.module.logps import LowRankTerm
from twinkle.module.multi_lora_params import parameter_lora_layer, parameter_lora_modules

if TYPE_CHECKING:
    from twinkle.module.multi_lora_images import ImageRows


@dataclass
class LoraWeights:
    """One adapter on one linear layer: ``delta(x) = dropout(x) @ A_RI.T @ B_OR.T * scaling``."""

    A_RI: torch.Tensor
    B_OR: torch.Tensor
    scaling: float
    dropout: float = 0.0  # applied to the adapter's input in training mode only, as in PEFT

    @property
    def rank(self) -> int:
        return self.A_RI.shape[0]

    def delta(self, x_NI: torch.Tensor, training: bool = False) -> torch.Tensor:
        """The low-rank update for rows ``x_NI`` (any leading shape, last dim = in_features)."""
        return self.down(x_NI, training) @ self.B_OR.T * self.scaling

    def down(self, x_NI: torch.Tensor, training: bool = False) -> torch.Tensor:
        """``dropout(x) @ A.T``: the update's first, rank-wide half."""
        if training and self.dropout > 0:
            x_NI = nn.functional.dropout(x_NI, self.dropout, training=True)
        return x_NI @ self.A_RI.T


@dataclass(frozen=True)
class RowRouting:
    """Which rows of the batch each adapter applies to; ``rows=None`` means every row."""

    batch_size: int
    groups: tuple[tuple[str, torch.Tensor | None], ...]
    # The same assignment for layers that see the rows' tokens flattened in other counts (a vision tower's
    # patches, then its merged patches): the routing whose ``batch_size`` is the layer's input count applies.
    alternates: tuple[RowRouting, ...] = ()

    @classmethod
    def of_rows(cls, row_adapters: Sequence[str | None], device: torch.device) -> RowRouting:
        """Row ``i`` to adapter ``row_adapters[i]`` (``None``: no adapter), index tensors on ``device``."""
        rows_by_name: dict[str, list[int]] = {}
        for row, name in enumerate(row_adapters):
            if name is not None:
                rows_by_name.setdefault(name, []).append(row)
        batch_size = len(row_adapters)
        groups = tuple(
            (name, None if len(rows) == batch_size else torch.tensor(rows, dtype=torch.long, device=device))
            for name, rows in rows_by_name.items()
        )
        return cls(batch_size, groups)

    def of_input(self, count: int) -> RowRouting:
        """The routing for a layer input of ``count`` rows (or flattened tokens)."""
        for routing in (self, *self.alternates):
            if routing.batch_size == count:
                return routing
        raise InvalidInputError(
            f"adapter_rows assigned {self.batch_size} rows but the batch has {count}: "
            "give one adapter name (or None) per batch row"
        )

    def for_tokens(self, rows_N: torch.Tensor) -> RowRouting:
        """The same assignment for ``N`` flattened tokens, token ``n`` being one of batch row ``rows_N[n]``."""
        groups: list[tuple[str, torch.Tensor | None]] = []
        for name, rows in self.groups:
            if rows is None:  # the adapter of every row is the adapter of every token
                groups.append((name, None))
                continue
            tokens = torch.isin(rows_N, rows).nonzero(as_tuple=True)[0]
            if tokens.numel() == rows_N.numel():
                groups.append((name, None))
            elif tokens.numel():
                groups.append((name, tokens))
        return RowRouting(rows_N.numel(), tuple(groups))


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus any number of named LoRA adapters applied per row.

    The base ``weight`` and ``bias`` are the very parameters of the wrapped
    linear (same keys, same storage); outside :func:`adapter_rows` every row
    gets the base projection only. Adapters live in ``adapters`` and are
    installed with :func:`set_adapter_weights`.
    """

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ConfigurationError(f"MultiLoraLinear wraps an nn.Linear, got {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.adapters: dict[str, LoraWeights] = {}
        self.routing: RowRouting | None = None
        # A multi-LoRA kernel (``twinkle.kernel``'s op "multi_lora", set by ``kernelize``): every adapter's
        # update in one call, ``lora_kernel(x_NI, [(A, B, scaling)...], adapter_N)``, instead of a loop.
        self.lora_kernel: Callable[..., torch.Tensor] | None = None

    def checked_weights(
        self, name: str, A_RI: torch.Tensor, B_OR: torch.Tensor, scaling: float, dropout: float = 0.0
    ) -> LoraWeights:
        """Validate shapes and move the tensors to the base weight's device and dtype (a no-op when already there)."""
        a_ok = A_RI.dim() == 2 and A_RI.shape[1] == self.in_features
        if not a_ok or tuple(B_OR.shape) != (self.out_features, A_RI.shape[0]):
            raise InvalidInputError(
                f"adapter {name!r}: A must be [rank, {self.in_features}] and B [{self.out_features}, rank], "
                f"got A {list(A_RI.shape)} and B {list(B_OR.shape)}"
            )
        device, dtype = self.weight.device, self.weight.dtype
        return LoraWeights(A_RI.to(device, dtype), B_OR.to(device, dtype), float(scaling), float(dropout))

    def low_rank_terms(self, x_NI: torch.Tensor, rows_N: torch.Tensor) -> list[LowRankTerm]:
        """The current adapters' updates of this layer's output on flattened tokens, as :class:`LowRankTerm` s.

        Token ``n`` is one of batch row ``rows_N[n]`` under :func:`adapter_rows`;
        ``self(x_NI)`` would equal ``x_NI @ weight.T`` plus every term, which lets
        :func:`chunked_token_logps` fold an adapted output layer into its chunks.
        """
        if self.routing is None:
            return []
        terms = []
        for name, tokens in self.routing.for_tokens(rows_N).groups:
            lora = self.adapters.get(name)
            if lora is None:  # this adapter does not target this layer
                continue
            x_nI = x_NI if tokens is None else x_NI.index_select(0, tokens)
            terms.append(LowRankTerm(tokens, lora.down(x_nI, self.training) * lora.scaling, lora.B_OR))
        return terms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed_forward(x, self.routing)

    def routed_forward(self, x: torch.Tensor, routing: RowRouting | None) -> torch.Tensor:
        """The forward with rows assigned by ``routing`` instead of the current :func:`adapter_rows` block."""
        out = nn.functional.linear(x, self.weight, self.bias)
        if routing is None or not self.adapters:
            return out
        routing = routing.of_input(x.shape[0])
        # The adapters in this batch that target this layer, with their rows.
        loras = [(rows, self.adapters[name]) for name, rows in routing.groups if name in self.adapters]
        # The kernel takes one input for every adapter, so input dropout (per adapter) runs the loop.
        if self.lora_kernel is not None and not (self.training and any(lora.dropout > 0 for _, lora in loras)):
            return out + self._kernel_delta(x, loras, self.lora_kernel)
        # In place: autograd saves the linear's inputs, not its output, and a copy of the whole output per
        # adapter in the batch would cost more than the adapters themselves.
        for rows, lora in loras:
            if rows is None:  # every row uses this adapter: no gather needed
                out.add_(lora.delta(x, self.training))
                continue
            out.index_add_(0, rows, lora.delta(x.index_select(0, rows), self.training))
        return out

    def _kernel_delta(
        self, x: torch.Tensor, loras: list[tuple[torch.Tensor | None, LoraWeights]], kernel: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        """Every row's adapter update in one kernel call over the flattened tokens."""
        adapter_B = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
        for index, (rows, _) in enumerate(loras):
            adapter_B[slice(None) if rows is None else rows] = index
        x_NI = x.reshape(-1, x.shape[-1])
        tokens_per_row = x_NI.shape[0] // x.shape[0]
        weights = [(lora.A_RI, lora.B_OR, lora.scaling) for _, lora in loras]
        delta_NO = kernel(x_NI, weights, adapter_B.repeat_interleave(tokens_per_row))
        return delta_NO.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        ranks = {name: lora.rank for name, lora in self.adapters.items()}
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={ranks}"


def per_token(module: nn.Module, rows_N: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module`` as a function of ``N`` flattened tokens, token ``n`` being one of batch row ``rows_N[n]``.

    For a :class:`MultiLoraLinear` inside an :func:`adapter_rows` block, each
    token gets its row's adapter. The assignment is taken now, so the function
    computes the same when autograd recomputes it later (a checkpointed chunk
    re-run in backward, after the block has ended). Any other module is
    returned as it is: it treats every token alike.
    """
    if not isinstance(module, MultiLoraLinear) or module.routing is None:
        return module
    return partial(module.routed_forward, routing=module.routing.for_tokens(rows_N))


def multi_lora_modules(model: nn.Module) -> dict[str, MultiLoraLinear]:
    """Every :class:`MultiLoraLinear` of ``model`` by its module name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, MultiLoraLinear)}


def inject_multi_lora(model: nn.Module, target_modules: Sequence[str] | str) -> list[str]:
    """Replace the ``nn.Linear`` modules named by ``target_modules`` with :class:`MultiLoraLinear`.

    ``target_modules`` is a list of name suffixes (``['q_proj', 'v_proj']``
    matches ``model.layers.0.self_attn.q_proj``; a dotted entry matches a
    longer suffix) or one regular expression matched against the whole name,
    as in PEFT. A list entry that is the full name of a parameter
    (``model.layers.0.mlp.experts.gate_up_proj``, PEFT's ``target_parameters``)
    wraps the module holding it in a :class:`~twinkle.module.MultiLoraExperts`
    (fused MoE experts) or :class:`~twinkle.module.MultiLoraRouter` (a router's
    2-D weight). Base weights are frozen: only adapters are meant to train.
    Already injected modules are kept as they are, so calling it again (say,
    for a new adapter's targets) is safe. Returns the names of every matching
    module or parameter, injected now or before.
    """
    targets = target_modules if isinstance(target_modules, str) else frozenset(target_modules)
    parameters = [] if isinstance(targets, str) else sorted(name for name in targets if _is_parameter(model, name))
    matched = []
    for name, module in list(model.named_modules()):
        if not _matches(name, targets) or not isinstance(module, (nn.Linear, MultiLoraLinear)):
            continue
        matched.append(name)
        if isinstance(module, MultiLoraLinear):
            continue
        module.requires_grad_(False)
        _replace(model, name, MultiLoraLinear(module))
    for name in parameters:
        owner_name, _, param = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        layer = parameter_lora_layer(owner, param)
        if not isinstance(owner, layer):
            owner.requires_grad_(False)
            _replace(model, owner_name, layer(owner))
        matched.append(name)
    if not matched:
        raise ConfigurationError(f"target_modules {target_modules!r} match no nn.Linear of {type(model).__name__}")
    return matched


def _is_parameter(model: nn.Module, name: str) -> bool:
    """``name`` is the full name of a parameter held by a module other than a linear layer."""
    owner_name, _, param = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return False
    return not isinstance(owner, (nn.Linear, MultiLoraLinear)) and param in dict(owner.named_parameters(recurse=False))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)


def _matches(name: str, targets: frozenset[str] | str) -> bool:
    """A regular expression matches the whole name; a set of names matches any dotted suffix of it."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    parts = name.split(".")
    return any(".".join(parts[start:]) in targets for start in range(len(parts)))


def set_adapter_weights(
    model: nn.Module,
    name: str,
    tensors_by_module: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scaling: float | Mapping[str, float],
    dropout: float = 0.0,
) -> None:
    """Install adapter ``name``: ``{module_name: (A_RI, B_OR)}``, replacing a previous adapter of that name.

    ``scaling`` is ``lora_alpha / r`` — one float, or one per module (ranks and
    alphas may vary by module); ``dropout`` is the adapter's input dropout
    probability in training mode. Tensors already on the base weight's device
    and dtype are used as they are, so a trainer's parameters get gradients.
    A key may also be a parameter's full name (see :func:`inject_multi_lora`),
    with PEFT's layout for it: fused experts ``[E, out, in]`` take
    ``A [r·E, in]`` and ``B [out, r·E]``. Every module must already be
    injected; nothing changes if any entry is invalid.
    """
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"adapter name must be a non-empty string, got {name!r}")
    if not tensors_by_module:
        raise InvalidInputError(f"adapter {name!r} has no tensors")
    modules = multi_lora_modules(model)
    parameter_layers = dict(parameter_lora_modules(model))
    missing = sorted(
        key for key in tensors_by_module if key not in modules and key.rpartition(".")[0] not in parameter_layers
    )
    if missing:
        raise ConfigurationError(
            f"adapter {name!r} targets {missing[:3]}, which are not MultiLoraLinear modules or adapted "
            "parameters; call inject_multi_lora(model, target_modules) first"
        )
    if isinstance(scaling, Mapping):
        unscaled = sorted(set(tensors_by_module) - set(scaling))
        if unscaled:
            raise InvalidInputError(f"adapter {name!r}: no scaling for modules {unscaled[:3]}")
    staged_linear, staged_parameters = [], []  # validate every entry before touching the model
    for key, (A_RI, B_OR) in tensors_by_module.items():
        key_scaling = scaling[key] if isinstance(scaling, Mapping) else scaling
        if key in modules:
            staged_linear.append((modules[key], modules[key].checked_weights(name, A_RI, B_OR, key_scaling, dropout)))
            continue
        if dropout:
            raise ConfigurationError(
                f"adapter {name!r}: lora_dropout must be 0 with LoRA on parameters ({key}), as in PEFT"
            )
        owner_name, _, param = key.rpartition(".")
        layer = parameter_layers[owner_name]
        staged_parameters.append((layer, param, layer.checked_weights(name, param, A_RI, B_OR, key_scaling)))
    remove_adapter(model, name, missing_ok=True)
    for module, lora in staged_linear:
        module.adapters[name] = lora
    for layer, param, parameter_lora in staged_parameters:
        layer.adapters.setdefault(name, {})[param] = parameter_lora


def remove_adapter(model: nn.Module, name: str, missing_ok: bool = False) -> None:
    """Drop adapter ``name`` from every layer, releasing its tensors (unless the caller still holds them)."""
    found = False
    for module in _lora_layers(model):
        found = module.adapters.pop(name, None) is not None or found
    if not found and not missing_ok:
        raise InvalidInputError(f"unknown adapter {name!r}; adapters: {adapter_names(model)}")


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the adapters installed on any layer of ``model``, sorted."""
    return sorted({name for module in _lora_layers(model) for name in module.adapters})


def _lora_layers(model: nn.Module) -> list[Any]:
    """Every layer of ``model`` that holds adapters: linear layers and adapted parameters."""
    return [*multi_lora_modules(model).values(), *(layer for _, layer in parameter_lora_modules(model))]


@contextmanager
def adapter_rows(
    model: nn.Module, row_adapters: Sequence[str | None], images: ImageRows | None = None
) -> Iterator[RowRouting]:
    """Within the block, batch row ``i`` of every forward uses adapter ``row_adapters[i]`` (``None``: base only).

    With ``images`` (a batch's images, see :class:`~twinkle.module.ImageRows`),
    the vision tower's layers give each image's patches the adapter of the row
    the image belongs to. Nested blocks restore the outer assignment on exit.
    Unknown adapter names are rejected up front, before any forward runs.
    """
    modules = _lora_layers(model)
    known = {name for module in modules for name in module.adapters}
    unknown = sorted({name for name in row_adapters if name is not None and name not in known})
    if unknown:
        raise InvalidInputError(f"unknown adapter(s) {unknown}; adapters: {sorted(known)}")
    device = next(modules[0].parameters()).device if modules else torch.device("cpu")
    routing = RowRouting.of_rows(row_adapters, device)
    tower = set() if images is None else {id(module) for module in images.tower.modules()}
    tower_routing = None if images is None else images.routing(routing)
    previous = [module.routing for module in modules]
    for module in modules:
        module.routing = tower_routing if id(module) in tower else routing
    try:
        yield routing
    finally:
        for module, outer in zip(modules, previous, strict=True):
            module.routing = outer
