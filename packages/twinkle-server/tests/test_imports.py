"""Every server module imports first, on its own: no import cycle waits for a particular import order.

A Ray replica unpickling a task imports the module that task's function lives in before anything else,
so a cycle that the usual entry point (``twinkle.server.application``) happens to hide breaks there.
"""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pathlib, sys
import twinkle.server
# Module names from the files (importing packages to walk them would trip over the very cycles looked for).
root = pathlib.Path(twinkle.server.__path__[0])
names = sorted(
    ".".join(("twinkle", "server", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
    for path in root.rglob("*.py")
)
failures = []
for name in names:
    for loaded in [m for m in sys.modules if m == "twinkle.server" or m.startswith("twinkle.server.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as error:
        failures.append(f"{name}: {type(error).__name__}: {error}")
print(len(names))
print("\\n".join(failures))
"""


def test_every_server_module_imports_first():
    completed = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    count, *failures = completed.stdout.splitlines()
    assert int(count) > 40, completed.stdout
    assert not [line for line in failures if line], "\n".join(failures)
