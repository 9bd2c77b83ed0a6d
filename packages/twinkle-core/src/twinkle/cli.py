"""The ``twinkle`` console command: one entry point, sub-commands from plugins.

Each distribution contributes its sub-commands through the entry-point group
``twinkle.cli`` (``sft = "twinkle.recipes.sft:main"``); a sub-command is a
callable taking the remaining ``argv`` and returning an exit code. Only the
chosen one is imported, so ``twinkle --help`` stays fast and torch-free.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points

ENTRY_POINT_GROUP = "twinkle.cli"


def _commands() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def _usage(commands: dict[str, EntryPoint]) -> str:
    lines = ["usage: twinkle <command> [options]", "", "commands:"]
    for name, ep in sorted(commands.items()):
        lines.append(f"  {name:<12} ({ep.value.split(':')[0]})")
    if not commands:
        lines.append("  (none installed: pip install twinkle-recipes or twinkle-all)")
    lines.append("\nRun 'twinkle <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not args or args[0] in ("-h", "--help"):
        print(_usage(commands))
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from twinkle import __version__

        print(f"twinkle {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in commands:
        print(f"twinkle: unknown command {name!r}\n\n{_usage(commands)}", file=sys.stderr)
        return 2
    return int(commands[name].load()(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
