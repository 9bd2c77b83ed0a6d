"""Shared fixtures for cross-package tests: facts about the workspace's distributions."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Triton kernels (test_model_kernels.py) run in Triton's CPU interpreter, which must be on before any kernel is
# decorated, whichever test file a session collects first (kernels/tests/conftest.py does the same).
os.environ.setdefault("TRITON_INTERPRET", "1")


def normalize(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Distribution:
    """One installable distribution of the workspace, as its pyproject.toml declares it."""

    name: str
    path: Path
    version: str
    dependencies: tuple[str, ...]
    optional_dependencies: dict[str, list[str]] = field(default_factory=dict)

    @staticmethod
    def requirement_name(requirement: str) -> str:
        return normalize(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])

    @property
    def dependency_names(self) -> set[str]:
        return {self.requirement_name(dep) for dep in self.dependencies}

    @property
    def optional_dependency_names(self) -> set[str]:
        return {self.requirement_name(dep) for deps in self.optional_dependencies.values() for dep in deps}

    @property
    def subpackages(self) -> list[str]:
        src = self.path / "src" / "twinkle"
        return sorted(p.name for p in src.iterdir() if p.is_dir() and p.name != "__pycache__") if src.is_dir() else []


def load_distributions() -> list[Distribution]:
    found = []
    pyprojects = [*REPO_ROOT.glob("packages/*/pyproject.toml"), *REPO_ROOT.glob("kernels/pyproject.toml")]
    for pyproject in sorted(pyprojects):
        project = tomllib.loads(pyproject.read_text())["project"]
        found.append(
            Distribution(
                name=project["name"],
                path=pyproject.parent,
                version=project["version"],
                dependencies=tuple(project.get("dependencies", [])),
                optional_dependencies=project.get("optional-dependencies", {}),
            )
        )
    return found


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def distributions() -> list[Distribution]:
    return load_distributions()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``leaf_distribution``: every installable distribution except the meta-package."""
    if "leaf_distribution" in metafunc.fixturenames:
        leaves = [d for d in load_distributions() if d.name != "twinkle-all"]
        metafunc.parametrize("leaf_distribution", leaves, ids=[d.name for d in leaves])
