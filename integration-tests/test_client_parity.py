"""``twinkle_client`` mirrors the in-process API: "change the import, keep the script".

Every public name of the mirrored in-process modules exists in the client
module of the same name, and every public method and property of each
in-process class exists on its client twin with the same parameters (names,
order, kinds, defaults), or the difference is listed, with its reason, in the
"Differences from in-process" table of ``packages/twinkle-client/README.md``.
That table must list exactly the differences that exist: a new gap fails this
test, and so does an entry that no longer describes one.

Members are named by the in-process class that defines them
(``TrainingModel.forward_backward_targets`` covers ``TransformersModel`` and
``MultiLoraModel``); ``+Class.name`` is a member only the client has.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from signatures import api_names, parameters, parity_problem

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[1] / "packages" / "twinkle-client" / "README.md"
SECTION = "## Differences from in-process"
# In-process class -> its client twin, both "module:Name".
TWINS = {
    "twinkle.model:TransformersModel": "twinkle_client.model:TransformersModel",
    "twinkle.model:MultiLoraModel": "twinkle_client.model:MultiLoraModel",
    "twinkle.sampler:TorchSampler": "twinkle_client.sampler:TorchSampler",
    "twinkle.sampler:vLLMSampler": "twinkle_client.sampler:vLLMSampler",
    "twinkle.dataset:Dataset": "twinkle_client.dataset:Dataset",
    "twinkle.dataset:DatasetMeta": "twinkle_client.dataset:DatasetMeta",
    "twinkle.dataloader:DataLoader": "twinkle_client.dataloader:DataLoader",
    "twinkle.template:Template": "twinkle_client.template:Template",
    "twinkle.checkpoint_engine:CheckpointEngineManager": "twinkle_client.checkpoint_engine:CheckpointEngineManager",
}
# Modules whose classes run locally on the client: it re-exports them, so they must be the same objects.
LOCAL_MODULES = ("advantage", "data_format", "metric", "preprocessor", "reward")


def resolve(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def documented_differences() -> dict[str, str]:
    """``{member: reason}`` from the README's table (rows like ``| `Dataset.mix`, `Dataset.add_dataset` | why |``)."""
    text = README.read_text()
    assert SECTION in text, f"{README} has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found: dict[str, str] = {}
    for members, reason in re.findall(r"^\| (`[^|]+`) \| (.*?) \|$", section, flags=re.MULTILINE):
        for member in re.findall(r"`([^`]+)`", members):
            assert member not in found, f"{member} is listed twice in {README}"
            found[member] = reason.strip()
    return found


def _owner_name(cls: type, name: str) -> str:
    """``Owner.name`` for the class in ``cls``'s MRO that defines ``name``."""
    owner = next(klass for klass in cls.__mro__ if name in vars(klass))
    return f"{owner.__name__}.{name}"


def _kind(cls: type, name: str) -> str:
    return "property" if isinstance(inspect.getattr_static(cls, name), property) else "method"


def class_differences(in_process: type, client: type) -> dict[str, str]:
    """``{member: what differs}`` between one class and its twin (``__init__`` included)."""
    ours, theirs = api_names(in_process) | {"__init__"}, api_names(client) | {"__init__"}
    found = {_owner_name(in_process, name): "only in-process" for name in ours - theirs}
    found |= {f"+{_owner_name(client, name)}": "only in the client" for name in theirs - ours}
    for name in sorted(ours & theirs):
        key = _owner_name(in_process, name)
        if _kind(in_process, name) != _kind(client, name):
            found[key] = f"a {_kind(in_process, name)} in-process, a {_kind(client, name)} in the client"
        elif _kind(in_process, name) == "method":
            problem = parity_problem(parameters(in_process, name), parameters(client, name))
            if problem:
                found[key] = problem
    return found


def module_differences(module: str, client_module: str) -> dict[str, str]:
    """Public names of ``module`` that ``client_module`` lacks."""
    ours, theirs = importlib.import_module(module), importlib.import_module(client_module)
    names = getattr(ours, "__all__", [name for name in vars(ours) if not name.startswith("_")])
    return {f"{module}:{name}": "only in-process" for name in names if not hasattr(theirs, name)}


def actual_differences() -> dict[str, str]:
    found: dict[str, str] = {}
    for in_process, client in TWINS.items():
        found |= module_differences(in_process.split(":")[0], client.split(":")[0])
        found |= class_differences(resolve(in_process), resolve(client))
    return found


def test_every_difference_from_in_process_is_documented_with_a_reason():
    documented, actual = documented_differences(), actual_differences()
    undocumented = {member: what for member, what in actual.items() if member not in documented}
    stale = sorted(set(documented) - set(actual))
    assert not undocumented, "undocumented differences (fix the client or add a README row with the reason):\n" + (
        "\n".join(f"{member}: {what}" for member, what in sorted(undocumented.items()))
    )
    assert not stale, f"README rows that no longer describe a difference: {stale}"
    assert all(documented.values()), [member for member, reason in documented.items() if not reason]


def test_a_renamed_parameter_or_a_missing_method_is_a_difference():
    class Model:
        def save(self, name: str, output_dir: str | None = None) -> str: ...

        def step(self) -> None: ...

    class RemoteModel:
        def save(self, name: str, directory: str | None = None) -> str: ...

        def run_id(self) -> str: ...

    found = class_differences(Model, RemoteModel)
    assert set(found) == {"Model.save", "Model.step", "+RemoteModel.run_id"}
    assert "('output_dir', 'POSITIONAL_OR_KEYWORD', 'None')" in found["Model.save"]


def test_the_locally_run_classes_are_the_in_process_ones():
    for name in LOCAL_MODULES:
        ours, theirs = importlib.import_module(f"twinkle.{name}"), importlib.import_module(f"twinkle_client.{name}")
        assert theirs.__all__ == ours.__all__, name
        assert all(getattr(theirs, item) is getattr(ours, item) for item in ours.__all__), name


def test_the_client_lora_config_is_a_subset_of_peft_s():
    """``twinkle_client.LoraConfig`` stands in for ``peft.LoraConfig``: its fields are peft's, by name."""
    import peft

    from twinkle_client import LoraConfig

    peft_fields = {field.name for field in dataclasses.fields(peft.LoraConfig)}
    assert {field.name for field in dataclasses.fields(LoraConfig)} <= peft_fields
