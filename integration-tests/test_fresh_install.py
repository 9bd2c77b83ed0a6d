"""Each distribution installs alone (with only what it declares) into a fresh venv and imports.

Wheels are built from the working tree; siblings come only from those wheels,
third-party packages from the package index. Packages promised to be torch-free
(design.md) are checked to install and import without torch.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

TORCH_FREE = {
    "twinkle-core",
    "twinkle-hub",
    "twinkle-dataset",
    "twinkle-template",
    "twinkle-preprocessor",
    "twinkle-dataloader",
    "twinkle-reward",
    "twinkle-advantage",
    "twinkle-metric",
    "twinkle-client",
}
TORCH_PIN = "torch==2.13.0"  # the CPU build CPU machines install locally (see Makefile)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory, distributions) -> Path:
    """A folder with a wheel of every leaf distribution, built from the working tree."""
    out = tmp_path_factory.mktemp("wheels")
    paths = [str(d.path) for d in distributions if d.name != "twinkle-all"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), *paths],
        check=True,
    )
    return out


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], check=True)


def _closure(dist, distributions) -> set[str]:
    """Every workspace distribution ``dist`` needs, itself included."""
    by_name = {d.name: d for d in distributions}
    needed, todo = set(), [dist.name]
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(dep for dep in by_name[name].dependency_names if dep in by_name)
    return needed


def test_installs_alone_and_imports(leaf_distribution, distributions, wheelhouse, tmp_path):
    dist = leaf_distribution
    expected = _closure(dist, distributions)
    by_name = {d.name: d for d in distributions}
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    if any("torch" in by_name[name].dependency_names for name in expected):
        _pip(python, TORCH_PIN)  # otherwise pip would fetch a multi-GB CUDA build
    _pip(python, "--find-links", str(wheelhouse), dist.name)
    modules = ["twinkle", *(f"twinkle.{sub}" for sub in dist.subpackages)]
    check = (
        "import importlib, importlib.util, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"torch_free = {dist.name in TORCH_FREE}\n"
        "assert not torch_free or importlib.util.find_spec('torch') is None, 'torch got installed'\n"
        "assert 'torch' not in sys.modules or not torch_free\n"
        "others = sorted(p for p in __import__('twinkle').__path__)\n"
        "print(others)\n"
    )
    result = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    siblings = {line.split("==")[0] for line in installed.stdout.splitlines() if line.startswith("twinkle")}
    assert siblings == expected, f"{dist.name} pulled in {siblings - expected}, lacks {expected - siblings}"


def test_third_party_plugin_resolves_by_name(wheelhouse, tmp_path):
    """A package that only depends on twinkle-core publishes a preprocessor that resolves by name."""
    plugin = tmp_path / "shout-plugin"
    (plugin / "shout_plugin").mkdir(parents=True)
    (plugin / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "shout-plugin"\nversion = "1.0"\ndependencies = ["twinkle-core"]\n'
        '[project.entry-points."twinkle.preprocessor"]\nShout = "shout_plugin:Shout"\n'
    )
    (plugin / "shout_plugin" / "__init__.py").write_text(
        "from twinkle.interfaces import Preprocessor\n\n"
        "class Shout(Preprocessor):\n"
        "    def __init__(self, suffix='!'):\n        self.suffix = suffix\n"
        "    def preprocess(self, row):\n"
        "        return {'messages': [{'role': 'user', 'content': row['text'].upper() + self.suffix}]}\n"
    )
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    _pip(python, "--find-links", str(wheelhouse), str(plugin))
    check = (
        "from twinkle.registry import build, get_registry\n"
        "shout = build('preprocessor', 'Shout', suffix='?')\n"
        "assert shout({'text': 'hi'})['messages'][0]['content'] == 'HI?', shout({'text': 'hi'})\n"
        "assert 'Shout' in get_registry('preprocessor').names()\n"
    )
    result = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
