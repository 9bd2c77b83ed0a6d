"""Each package uses only the names its siblings export, so a sibling can restructure its internals freely.

A distribution's public modules are the top-level packages it ships: ``twinkle.<sub>`` for a portion of the
``twinkle`` namespace (``twinkle-core`` also owns the root ``twinkle`` and modules such as ``twinkle.errors``),
or its own package (``twinkle_client``). Code in another distribution's ``src/`` may write
``from twinkle.<sub> import <name in its __all__>`` or ``import twinkle.<sub>``; a sibling's deeper modules
and ``_private`` names are its internals. ``__all__`` is read with ``ast``, nothing is imported, and every
import counts (function-local, ``if TYPE_CHECKING:``, relative).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class PublicModule:
    """A top-level module of a distribution and the names its ``__all__`` lists (``None``: it has none)."""

    name: str
    distribution: str
    exports: frozenset[str] | None


def declared_all(path: Path) -> frozenset[str] | None:
    """The literal ``__all__`` assigned at the top of a module, without importing it."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__" for target in node.targets):
            return frozenset(ast.literal_eval(node.value))
    return None


def public_modules(distributions) -> dict[str, PublicModule]:
    """Every distribution's top-level modules by dotted name."""
    found = {}
    for dist in distributions:
        src = dist.path / "src"
        packages = sorted(p for p in src.iterdir() if (p / "__init__.py").exists()) if src.is_dir() else []
        files = {package.name: package / "__init__.py" for package in packages if package.name != "twinkle"}
        namespace = src / "twinkle"
        if namespace.is_dir():
            if (namespace / "__init__.py").exists():
                files["twinkle"] = namespace / "__init__.py"
            for child in sorted(namespace.iterdir()):
                if (child / "__init__.py").exists():
                    files[f"twinkle.{child.name}"] = child / "__init__.py"
                elif child.suffix == ".py" and child.stem != "__init__":
                    files[f"twinkle.{child.stem}"] = child
        for name, path in files.items():
            found[name] = PublicModule(name, dist.name, declared_all(path))
    return found


def _owner(module: str, modules: dict[str, PublicModule]) -> PublicModule | None:
    parts = module.split(".")
    return modules.get(".".join(parts[:2]) if parts[0] == "twinkle" and len(parts) > 1 else parts[0])


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _refusal(imported: str, name: str, public: PublicModule) -> str | None:
    """Why ``from imported import name`` is not part of ``public``'s distribution's API, or ``None`` if it is."""
    dunder = name.startswith("__") and name.endswith("__")
    if imported == public.name and (name == "*" or dunder):
        return None
    if public.exports is None:
        return f"{public.distribution} does not export {name}: {public.name} has no __all__"
    if name.startswith("_") or name not in public.exports:
        return f"{public.distribution} does not export {name}"
    if imported != public.name:
        return f"{public.distribution} does not export {imported}: import {name} from {public.name}"
    return None


def sibling_import_violations(
    source: str, filename: str, package: str, distribution: str, modules: dict[str, PublicModule]
) -> list[str]:
    """``filename:line: <the import> (why)`` for each name ``source`` imports past a sibling's public API.

    ``package`` is the dotted package the file belongs to (for relative imports); ``distribution`` ships it.
    """
    violations = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                public = _owner(alias.name, modules)
                if public and public.distribution != distribution and alias.name != public.name:
                    why = f"{public.distribution} does not export {alias.name}"
                    violations.append(f"{filename}:{node.lineno}: import {alias.name} ({why})")
        elif isinstance(node, ast.ImportFrom):
            imported = _absolute(node, package)
            for alias in node.names:
                if imported == "twinkle" and f"twinkle.{alias.name}" in modules:
                    continue  # ``from twinkle import wire`` imports a public module
                public = _owner(imported, modules)
                why = public and public.distribution != distribution and _refusal(imported, alias.name, public)
                if why:
                    violations.append(f"{filename}:{node.lineno}: from {imported} import {alias.name} ({why})")
    return violations


def test_detector_flags_private_deep_and_unexported_names_only():
    modules = {
        "twinkle.model": PublicModule("twinkle.model", "twinkle-model", frozenset({"TransformersModel"})),
        "twinkle.server": PublicModule("twinkle.server", "twinkle-server", None),
        "twinkle.sampler": PublicModule("twinkle.sampler", "twinkle-sampler", frozenset()),
    }
    source = """
import twinkle.model
from twinkle.model import TransformersModel, __all__
from twinkle.model import *
from twinkle.model import _private, helper
from twinkle.model.checkpoint_io import atomic_directory, TransformersModel
if TYPE_CHECKING:
    import twinkle.model.targets
def build():
    from twinkle.server import app
from ..model.targets import check_sequences
from twinkle.sampler.results import own_internal
from twinkle import model
"""
    found = sibling_import_violations(source, "x.py", "twinkle.sampler", "twinkle-sampler", modules)
    assert sorted(found) == sorted(
        [
            "x.py:5: from twinkle.model import _private (twinkle-model does not export _private)",
            "x.py:5: from twinkle.model import helper (twinkle-model does not export helper)",
            "x.py:6: from twinkle.model.checkpoint_io import atomic_directory "
            "(twinkle-model does not export atomic_directory)",
            "x.py:6: from twinkle.model.checkpoint_io import TransformersModel "
            "(twinkle-model does not export twinkle.model.checkpoint_io: import TransformersModel from twinkle.model)",
            "x.py:8: import twinkle.model.targets (twinkle-model does not export twinkle.model.targets)",
            "x.py:10: from twinkle.server import app "
            "(twinkle-server does not export app: twinkle.server has no __all__)",
            "x.py:11: from twinkle.model.targets import check_sequences "
            "(twinkle-model does not export check_sequences)",
        ]
    )


def test_public_modules_cover_every_distribution(distributions):
    modules = public_modules(distributions)
    for dist in distributions:
        for sub in dist.subpackages:
            assert modules[f"twinkle.{sub}"].distribution == dist.name
    assert "TransformersModel" in (modules["twinkle.model"].exports or ())
    assert {"twinkle", "twinkle.errors", "twinkle_client"} <= set(modules)


def test_packages_import_only_what_siblings_export(distributions, repo_root):
    """Fix a violation by importing the name from the sibling's top-level package, adding it to that
    package's ``__all__`` if it is a helper other packages genuinely need."""
    modules = public_modules(distributions)
    violations = []
    for dist in distributions:
        src = dist.path / "src"
        for path in sorted(src.rglob("*.py")) if src.is_dir() else []:
            package = ".".join(path.relative_to(src).parts[:-1])  # what a relative import in it starts from
            where = str(path.relative_to(repo_root))
            violations += sibling_import_violations(path.read_text(), where, package, dist.name, modules)
    if violations:
        pytest.fail(f"{len(violations)} import(s) past a sibling's __all__:\n" + "\n".join(violations), pytrace=False)
