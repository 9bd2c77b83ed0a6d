"""Every component registered under a kind implements that kind's interface, by signature.

Built-ins are published as entry points (group ``twinkle.<kind>``), so
loading every entry point of every kind reaches every registered built-in;
the test also checks no built-in is registered without one. Each is checked
against its interface from ``twinkle.interfaces`` (torch's own base classes
for optimizers and LR schedulers): an ABC must be a base class, and every
declared method must exist with the same parameters (see
:func:`signatures.compatibility_problems`). A kind added without an
interface fails here too.
"""

from __future__ import annotations

import sys
import typing
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle import interfaces
from twinkle.registry import KINDS, get_registry

sys.path.insert(0, str(Path(__file__).parent))
from signatures import callable_parameters, member_problems

pytestmark = pytest.mark.integration

KIND_INTERFACES: dict[str, type] = {
    "dataset": interfaces.SizedDataset,
    "template": interfaces.Template,
    "preprocessor": interfaces.Preprocessor,
    "processor": interfaces.InputProcessor,
    "dataloader": interfaces.DataLoader,
    "model": interfaces.Model,
    "sampler": interfaces.Sampler,
    "loss": interfaces.Loss,
    "advantage": interfaces.Advantage,
    "reward": interfaces.Reward,
    "metric": interfaces.Metric,
    "tool_parser": interfaces.ToolCallParser,
    "env": interfaces.Env,
    "checkpoint_engine": interfaces.CheckpointEngine,
    "kernel": interfaces.Kernel,
    "patch": interfaces.Patch,
    "optimizer": torch.optim.Optimizer,
    "lr_scheduler": torch.optim.lr_scheduler.LRScheduler,
}
# torch's classes are built by the model with the adapter's parameters / optimizer as this argument.
TORCH_KINDS = {"optimizer": "params", "lr_scheduler": "optimizer"}


def published(kind: str) -> dict[str, Any]:
    """Entry-point name -> loaded component, for every distribution installed here."""
    return {ep.name: ep.load() for ep in entry_points(group=f"twinkle.{kind}")}


def conformance_problems(kind: str, component: Any) -> list[str]:
    interface = KIND_INTERFACES[kind]
    if kind in TORCH_KINDS:
        return _torch_problems(kind, component, interface)
    if not isinstance(component, type):
        return [f"{component!r} is not a class"]
    if not getattr(interface, "_is_protocol", False) and not issubclass(component, interface):
        return [f"{component.__name__} does not subclass {interface.__module__}.{interface.__name__}"]
    return member_problems(interface, component)


def _torch_problems(kind: str, component: Any, base: type) -> list[str]:
    """A subclass of torch's base (or a factory returning one) taking the argument the model passes."""
    argument = TORCH_KINDS[kind]
    built = component if isinstance(component, type) else typing.get_type_hints(component).get("return")
    name = getattr(component, "__name__", repr(component))
    problems = []
    if not (isinstance(built, type) and issubclass(built, base)):
        problems.append(f"{name} does not build a {base.__module__}.{base.__name__}")
    if argument not in [p.name for p in callable_parameters(component)]:
        problems.append(f"{name} takes no {argument!r} argument")
    return problems


def test_every_kind_has_an_interface():
    assert set(KIND_INTERFACES) == set(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_registered_components_implement_their_interface(kind):
    components = published(kind)
    registry = get_registry(kind)
    builtins = {
        name: registry.get(name)
        for name in registry.names()
        if getattr(registry.get(name), "__module__", "").startswith("twinkle.")
    }
    unpublished = sorted(set(builtins) - set(components))
    assert not unpublished, f"built-in {kind}s registered without an entry point in twinkle.{kind}: {unpublished}"
    problems = []
    for component in {id(c): c for c in components.values()}.values():  # aliases name one component twice
        problems += conformance_problems(kind, component)
    assert not problems, "\n".join(problems)


class _DriftedModel:
    """A model whose ``forward_backward`` lost ``micro_batch_size``, whose ``save`` requires ``output_dir``,
    and which has no ``step``."""

    adapter_names = property(lambda self: [])

    def forward_backward(self, inputs: Any, adapter_name: str | None = None, **loss_inputs: Any) -> Any: ...

    def zero_grad(self, adapter_name: str | None = None, force: bool = False) -> None: ...

    def save(self, name: str, output_dir: str, save_optimizer: bool = True) -> str: ...

    def load(
        self, path: str, adapter_name: str | None = None, load_optimizer: bool = True, strict: Any = ...
    ) -> None: ...


class _NoLengthTemplate:
    def encode(self, trajectory: Any) -> Any: ...

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, *, errors: str) -> str: ...


def test_a_drifted_component_is_reported_member_by_member():
    problems = conformance_problems("model", _DriftedModel)
    for expected in (
        "_DriftedModel.forward_backward: positional parameter 1 is 'adapter_name', the interface's is "
        "'micro_batch_size'",
        "_DriftedModel.save: 'output_dir' is required, the interface's is optional (= None)",
        "_DriftedModel.save: no positional parameter 3, the interface's 'adapter_name'",
        "_DriftedModel.load: 'load_optimizer' defaults to True, the interface's to False",
        "_DriftedModel.step: missing method",
    ):
        assert expected in problems
    assert not [problem for problem in problems if problem.startswith("_DriftedModel.zero_grad")]  # extra optional
    assert not [problem for problem in problems if "adapter_names" in problem]


def test_protocol_attributes_extra_required_parameters_and_abc_bases():
    problems = conformance_problems("template", _NoLengthTemplate)
    assert (
        "_NoLengthTemplate.max_length: missing attribute (not a class attribute nor a constructor argument)" in problems
    )
    assert "_NoLengthTemplate.encode: no positional parameter 1, the interface's 'add_generation_prompt'" in problems
    assert "_NoLengthTemplate.decode: extra required parameter 'errors' that the interface does not declare" in problems
    loss = get_registry("loss").get("CrossEntropyLoss")
    assert conformance_problems("metric", loss) == [
        "CrossEntropyLoss does not subclass twinkle.interfaces.training.Metric"
    ]


def test_optimizers_and_schedulers_are_torch_classes_built_on_what_the_model_passes():
    assert conformance_problems("optimizer", torch.optim.SGD) == []
    assert conformance_problems("optimizer", _DriftedModel) == [
        "_DriftedModel does not build a torch.optim.optimizer.Optimizer",
        "_DriftedModel takes no 'params' argument",
    ]
    assert conformance_problems("lr_scheduler", get_registry("lr_scheduler").get("default")) == []
