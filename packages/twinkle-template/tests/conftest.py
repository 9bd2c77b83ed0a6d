"""Shared fixtures: the built-in tiny Qwen3 tokenizer, loaded once per session."""

from __future__ import annotations

import os
import tempfile

import pytest
from transformers import AutoTokenizer

from twinkle.hub import resolve_model
from twinkle.template import Template

# Build the built-in model once per session, into a throwaway cache unless one is configured.
os.environ.setdefault("TWINKLE_CACHE_DIR", tempfile.mkdtemp(prefix="twinkle-template-tests-"))


@pytest.fixture(scope="session")
def model_dir() -> str:
    return resolve_model("builtin://qwen3-tiny")


@pytest.fixture(scope="session")
def template(model_dir: str) -> Template:
    return Template(model_dir, max_length=None)


@pytest.fixture(scope="session")
def tokenizer(template: Template):
    return template.tokenizer


@pytest.fixture
def fresh_tokenizer(model_dir: str):
    """A tokenizer the test may modify (e.g. remove its chat template)."""
    return AutoTokenizer.from_pretrained(model_dir)


def trained_texts(template: Template, feature: dict) -> list[str]:
    """The decoded runs of consecutive labelled tokens."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(feature["input_ids"], feature["labels"], strict=True):
        trained = label != -100
        if trained and not previous:
            runs.append([])
        if trained:
            runs[-1].append(token)
        previous = trained
    return [template.decode(run) for run in runs]


@pytest.fixture(scope="session")
def trained():
    return trained_texts
