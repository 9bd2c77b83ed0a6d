"""``twinkle download MODEL_OR_DATASET``: fetch (or build) it and print its local path.

Tools that take a local folder (a tokenizer for tinker-cookbook recipes, a
model for another framework) get the embedded default or a hub id this way:
``model_name=$(twinkle download builtin://qwen3-tiny)``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from twinkle.errors import TwinkleError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="twinkle download", description="Print the local path of a model or dataset, fetching it first."
    )
    parser.add_argument(
        "id", nargs="?", default=None, help="builtin://, hf://, ms:// id or local path (default: the embedded model)"
    )
    parser.add_argument("--dataset", action="store_true", help="resolve a dataset id instead of a model id")
    args = parser.parse_args(argv)
    from twinkle.hub import resolve_dataset, resolve_model

    try:
        if args.dataset:
            if args.id is None:
                parser.error("--dataset needs an id")
            path = resolve_dataset(args.id)
        else:
            path = resolve_model(args.id)
    except TwinkleError as exc:
        print(f"twinkle download: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
