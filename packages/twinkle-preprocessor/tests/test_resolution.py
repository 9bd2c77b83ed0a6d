"""as_preprocessor, registry entry points, and the torch-free import guarantee."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.preprocessor import FunctionPreprocessor, GSM8KProcessor, SelfCognitionProcessor, as_preprocessor
from twinkle.registry import get_registry

BUILTINS = [
    "AlpacaProcessor",
    "DPOProcessor",
    "FunctionPreprocessor",
    "GSM8KProcessor",
    "MessagesProcessor",
    "SelfCognitionProcessor",
]


def test_plain_function_becomes_a_preprocessor() -> None:
    def to_chat(row):
        return {"messages": [{"role": "user", "content": row["text"]}]}

    processor = as_preprocessor(to_chat)
    assert isinstance(processor, FunctionPreprocessor)
    assert processor({"text": "hi"}) == {"messages": [{"role": "user", "content": "hi"}]}
    assert "to_chat" in repr(processor)


def test_instances_classes_and_names_resolve() -> None:
    instance = SelfCognitionProcessor("n", "a")
    assert as_preprocessor(instance) is instance
    built = as_preprocessor("GSM8KProcessor", include_solution=True)
    assert isinstance(built, GSM8KProcessor) and built.include_solution
    assert isinstance(as_preprocessor(GSM8KProcessor), GSM8KProcessor)
    assert isinstance(as_preprocessor("twinkle.preprocessor:AlpacaProcessor"), Preprocessor)


def test_unusable_specs_are_rejected() -> None:
    with pytest.raises(InvalidInputError, match="expected a Preprocessor, a preprocessor name or a function"):
        as_preprocessor(42)
    with pytest.raises(ConfigurationError, match="already an instance"):
        as_preprocessor(SelfCognitionProcessor("n", "a"), model_name="other")
    with pytest.raises(InvalidInputError, match="FunctionPreprocessor needs a callable"):
        FunctionPreprocessor("not callable")


def test_builtins_are_published_as_entry_points() -> None:
    published = {ep.name: ep for ep in entry_points(group="twinkle.preprocessor")}
    assert set(BUILTINS) <= set(published)
    for name in BUILTINS:
        assert published[name].load() is get_registry("preprocessor").get(name)


def test_import_needs_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, twinkle.preprocessor\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
