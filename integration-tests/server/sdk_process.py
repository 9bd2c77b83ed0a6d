"""The command line that runs a tinker-SDK program (a script or ``-m module``) unmodified, as a user would.

One difference from ``python program``: once the program has finished (returned, raised or called
``sys.exit``), the process runs the ``atexit`` handlers, flushes its output and leaves with ``os._exit``,
skipping interpreter finalization. On Python 3.11-3.13, finalization races the tinker SDK's daemon
event-loop thread: a daemon thread that wakes during it is ended by ``pthread_exit``, which at random
aborts the whole process (SIGABRT, exit -6) after the program itself succeeded (CPython gh-87135; 3.14
hangs such threads instead). The program's exit status is still what the program decided.
"""

from __future__ import annotations

import sys

LAUNCHER = """
import atexit, os, pathlib, runpy, sys, traceback
kind, target = sys.argv[1], sys.argv[2]
sys.argv = [target, *sys.argv[3:]]
status = 0
try:
    if kind == "-m":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = str(pathlib.Path(target).parent)  # as 'python script' sets it
        runpy.run_path(target, run_name="__main__")
except SystemExit as exit:
    if isinstance(exit.code, int) or exit.code is None:
        status = exit.code or 0
    else:
        print(exit.code, file=sys.stderr)
        status = 1
except BaseException:
    traceback.print_exc()
    status = 1
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)
"""


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module args...``, leaving without interpreter finalization."""
    return [sys.executable, "-X", "faulthandler", "-c", LAUNCHER, "-m", module, *args]


def script_command(script: str, *args: str) -> list[str]:
    """``python script args...``, leaving without interpreter finalization."""
    return [sys.executable, "-X", "faulthandler", "-c", LAUNCHER, "script", script, *args]
