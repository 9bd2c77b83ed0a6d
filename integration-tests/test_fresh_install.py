"""Each distribution installs alone (with only what it declares) into a fresh venv and imports.

Wheels are built once from the working tree. Each test makes an empty venv and asks uv to install one
distribution by name under a constraints file that pins every workspace name to its wheel (``name @ file://``),
so siblings can only come from the working tree and only those its declarations pull get installed;
third-party packages come from the package index (uv's: PyPI unless UV_INDEX_URL etc. say otherwise).
Packages promised to be torch-free (design.md) are checked to install and import without torch.

Why it is fast and still honest (pip took ~7 min idle: a venv, a resolution and a torch unpack per distribution):
- uv resolves in about a second and installs by hard-linking from its cache (uv's usual one, so reruns skip
  downloads too): torch, transformers, pyarrow... are unpacked once, then linked into each venv in seconds.
  Each venv holds only what its own resolution picked; nothing is pre-seeded.
- torch is pinned by URL to the wheel pip (with this machine's configuration) resolves for the torch this venv
  runs, a local CPU build here: uv never fetches a multi-GB CUDA build, and a torch-free distribution that
  wrongly pulls torch fails cheaply on the torch check.
- Importing torch/transformers/peft from source is most of what is left, so every venv sits at the same path
  (deleted and re-created per test) and the import check keeps bytecode under one ``pycache_prefix``; Python
  reuses a .pyc only while the source at that path still matches it (mtime and size).
- Rejected: a shared, pre-installed "torch layer" put on sys.path by a .pth file (uv, like pip, counts only the
  venv's own site-packages as installed and would install torch again; hard links already make that cheap), and
  running installs in parallel (2 cores).
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
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

# What a distribution promises when installed alone, beyond importing (run in its venv).
ALONE_CHECKS = {
    # The Tinker API is a plugin whose SDK comes with the [tinker] extra: without it, the native API and the
    # OpenAI-compatible one (which needs nothing more).
    "twinkle-server": (
        "from twinkle.server.apis import load_apis\nnames = [api.name for api in load_apis(None)]\n"
        "assert names == ['openai'], names\n"
    ),
    # Without triton and torch-npu (CPU users) every kernel says why it falls back, and still computes.
    "twinkle-kernels": (
        "import torch\nfrom twinkle.registry import build, get_registry\n"
        "assert importlib.util.find_spec('triton') is None and importlib.util.find_spec('torch_npu') is None\n"
        "names = get_registry('kernel').names()\nassert len(names) >= 9, names\n"
        "for name in names:\n"
        "    reason = build('kernel', name).unavailable_reason(torch.device('cpu'))\n"
        "    assert reason and ('not installed' in reason), (name, reason)\n"
        "norm = build('kernel', 'TritonRMSNorm')(torch.ones(2, 4), torch.ones(4), 1e-6)\n"
        "assert torch.allclose(norm, torch.ones(2, 4), atol=1e-5)\n"
    ),
}

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def uv() -> str:
    try:
        from uv import find_uv_bin
    except ImportError:
        pytest.fail("uv is missing: it is in requirements-dev.txt, run `make install`")
    return find_uv_bin()


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


def _torch_wheel_url() -> str:
    """Where pip (with this machine's configuration) gets the torch build this venv runs."""
    try:
        spec = f"torch=={importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("torch is not installed in the test venv; run `make install`")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--no-deps", "--ignore-installed"]
    result = subprocess.run([*command, "--report", "-", spec], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"pip cannot resolve {spec} (the torch this venv runs):\n{result.stderr}")
    return json.loads(result.stdout)["install"][0]["download_info"]["url"]


@pytest.fixture(scope="module")
def constraints(tmp_path_factory, wheelhouse) -> Path:
    """Pins every workspace distribution to its working-tree wheel and torch to the local build."""
    lines = [f"{wheel.name.split('-')[0].replace('_', '-')} @ {wheel.as_uri()}" for wheel in wheelhouse.glob("*.whl")]
    path = tmp_path_factory.mktemp("constraints") / "constraints.txt"
    path.write_text("\n".join([*sorted(lines), f"torch @ {_torch_wheel_url()}"]) + "\n")
    return path


class FreshVenv:
    """Empty venvs, one at a time, always at the same path so that their imports share one bytecode cache."""

    def __init__(self, root: Path, uv: str, constraints: Path) -> None:
        self.venv, self.pycache, self.uv, self.constraints = root / "venv", root / "pycache", uv, constraints
        self.python = self.venv / "bin" / "python"

    def install(self, *requirements: str) -> None:
        """Replace the venv with a new one holding ``requirements`` and what they declare."""
        shutil.rmtree(self.venv, ignore_errors=True)
        self._uv("venv", "--python", sys.executable, str(self.venv))
        self._uv("pip", "install", "--python", str(self.python), "--constraint", str(self.constraints), *requirements)

    def run(self, code: str) -> subprocess.CompletedProcess:
        """Run ``code`` in the venv ignoring PYTHON* variables and the working directory (-I)."""
        command = [str(self.python), "-I", "-X", f"pycache_prefix={self.pycache}", "-c", code]
        return subprocess.run(command, capture_output=True, text=True)

    def _uv(self, *args: str) -> None:
        result = subprocess.run([self.uv, *args, "--quiet"], capture_output=True, text=True)
        assert result.returncode == 0, f"uv {' '.join(args)} failed:\n{result.stderr}"


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, uv, constraints) -> FreshVenv:
    return FreshVenv(tmp_path_factory.mktemp("fresh"), uv, constraints)


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


def _modules(dist) -> list[str]:
    """What the distribution ships: ``twinkle``'s subpackages and modules there, and any other top-level package."""
    src = dist.path / "src"
    inner = [p.stem for p in (src / "twinkle").glob("*.py") if p.stem != "__init__"]
    others = [p.name for p in src.glob("*") if p.name != "twinkle" and (p / "__init__.py").is_file()]
    return ["twinkle", *(f"twinkle.{name}" for name in sorted([*dist.subpackages, *inner])), *sorted(others)]


def test_installs_alone_and_imports(leaf_distribution, distributions, fresh_venv):
    dist = leaf_distribution
    expected = _closure(dist, distributions)
    fresh_venv.install(dist.name)
    modules = _modules(dist)
    check = (
        "import importlib, importlib.metadata, importlib.util, json\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"assert not {dist.name in TORCH_FREE} or importlib.util.find_spec('torch') is None, 'torch got installed'\n"
        f"{ALONE_CHECKS.get(dist.name, '')}"
        "print(json.dumps(sorted(d.metadata['Name'] for d in importlib.metadata.distributions())))\n"
    )
    result = fresh_venv.run(check)
    assert result.returncode == 0, f"{dist.name} does not import alone:\n{result.stderr}"
    siblings = {name for name in json.loads(result.stdout) if name.startswith("twinkle")}
    assert siblings == expected, f"{dist.name} pulled in {siblings - expected}, lacks {expected - siblings}"


def test_third_party_plugin_resolves_by_name(fresh_venv, tmp_path):
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
    fresh_venv.install(str(plugin))
    check = (
        "from twinkle.registry import build, get_registry\n"
        "shout = build('preprocessor', 'Shout', suffix='?')\n"
        "assert shout({'text': 'hi'})['messages'][0]['content'] == 'HI?', shout({'text': 'hi'})\n"
        "assert 'Shout' in get_registry('preprocessor').names()\n"
    )
    result = fresh_venv.run(check)
    assert result.returncode == 0, result.stderr
