"""``twinkle server``: run the server, add a user (printing a new API key once), check a config file.

Registered as the ``server`` command of the ``twinkle`` console script (entry
point group ``twinkle.cli``). The server itself (FastAPI, torch, the model) is
imported only when serving, so ``add-user`` and ``check-config`` stay fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.server.auth import issue_api_key
from twinkle.server.config import DEFAULT_STATE_DIR, check_config, load_config
from twinkle.server.store import SQLiteStore

PROG = "twinkle server"
_SUBCOMMANDS = ("add-user", "check-config")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``twinkle server [add-user|check-config] ...``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "add-user":
            return _add_user(_add_user_parser().parse_args(args[1:]))
        if args and args[0] == "check-config":
            return _check_config(_check_config_parser().parse_args(args[1:]))
        return _serve(_serve_parser().parse_args(args))
    except (ConfigurationError, InvalidInputError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a base model to many users, each training their own LoRA adapters over HTTP.",
        epilog=(
            "other commands:\n"
            f"  {PROG} add-user NAME      create a user and print a new API key\n"
            f"  {PROG} check-config FILE  list every problem in a config file\n\n"
            "Flags override the config file; the file overrides the defaults."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_flags(parser)
    parser.add_argument("--host", help="interface to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000; 0 picks a free one)")
    parser.add_argument(
        "--ray", action="store_true", default=None, help="the model as a Ray Serve deployment (local Ray, 127.0.0.1)"
    )
    parser.add_argument("--replicas", type=int, metavar="N", help="model replicas under --ray (default 1)")
    return parser


def _add_user_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} add-user",
        description=(
            "Create user NAME in the server database (or find it) and issue a new API key. The key is printed "
            "once on stdout; only its hash is stored. Works while the server is running."
        ),
    )
    parser.add_argument("name", metavar="NAME", help="user name: letters, digits, '_', '.', '-'")
    _add_config_flags(parser)
    return parser


def _check_config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} check-config",
        description="Print every problem in a server config file; exit 1 if there is any, else print OK.",
    )
    parser.add_argument("file", metavar="FILE", type=Path, help="YAML server config")
    return parser


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML server config")
    parser.add_argument(
        "--state-dir",
        type=Path,
        metavar="DIR",
        help=f"folder for the database and checkpoints (default {DEFAULT_STATE_DIR})",
    )


def _serve(args: argparse.Namespace) -> int:
    config = load_config(
        args.config, host=args.host, port=args.port, state_dir=args.state_dir, ray=args.ray, replicas=args.replicas
    )
    from twinkle.server.application import run_server

    run_server(config)
    return 0


def _add_user(args: argparse.Namespace) -> int:
    config = load_config(args.config, state_dir=args.state_dir)
    with SQLiteStore(config.database) as store:
        existed = store.get_user(args.name) is not None
        store.add_user(args.name)
        key = issue_api_key(store, args.name)
    action = "already existed; issued an additional API key" if existed else "created"
    print(f"User {args.name!r} {action} in {config.database}.", file=sys.stderr)
    print("API key (shown only this once; it cannot be shown again, only its hash is stored):", file=sys.stderr)
    print(key)
    return 0


def _check_config(args: argparse.Namespace) -> int:
    problems = check_config(args.file)
    for problem in problems:
        print(f"{args.file}: {problem}")
    if not problems:
        print("OK")
    return 1 if problems else 0
