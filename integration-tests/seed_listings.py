"""The seeds' code listings (``../shared/seeds/*.txt``, text taken from web pages), to run them as written.

:func:`listing` cuts one listing out of a seed's prose, repairs what the page
did to its whitespace, and applies the few substitutions a test states (a model
id, device counts), each of which must occur, so that a changed seed fails
loudly instead of running something else. Without the seeds folder (a checkout
outside the project's workspace) the calling test is skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SEEDS_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "seeds"
INDENT = 4  # the listings' indentation unit


def listing(seed_prefix: str, start_marker: str, substitutions: dict[str, str], end_marker: str | None = None) -> str:
    """The listing of seed ``seed_prefix`` (e.g. ``"001"``) that starts at the line containing ``start_marker``.

    It ends at the line containing ``end_marker``, or else where the page's
    prose resumes: the first line that starts with a non-ASCII character.
    Raises AssertionError if a marker or a substitution's text is missing, or
    if the result is not valid Python.
    """
    lines = _seed_text(seed_prefix).splitlines()
    start = next((i for i, line in enumerate(lines) if start_marker in line), None)
    assert start is not None, f"seed {seed_prefix}: no line contains {start_marker!r}"
    end = start + 1
    while end < len(lines) and not _ends_listing(lines[end], end_marker):
        end += 1
    if end_marker is not None:
        assert end < len(lines), f"seed {seed_prefix}: no line after {start_marker!r} contains {end_marker!r}"
        end += 1  # the marker's line belongs to the listing
    source = normalize_whitespace("\n".join(lines[start:end]))
    for old, new in substitutions.items():
        assert old in source, f"seed {seed_prefix}'s listing no longer contains {old!r}"
        source = source.replace(old, new)
    compile(source, f"seed {seed_prefix} listing", "exec")
    return source


def normalize_whitespace(source: str) -> str:
    """Undo a web page's changes to code: no-break spaces, trailing blanks, and the extra space it puts at
    the start of a line after a blank line (`` def train():``), which leaves that line one space off the
    indentation grid. Source that already compiles is kept as it is (but for trailing blanks)."""
    lines = [line.replace("\u00a0", " ").rstrip() for line in source.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    text = "\n".join(lines) + "\n"
    if _compiles(text):
        return text
    return "\n".join(line[1:] if _indent(line) % INDENT == 1 else line for line in lines) + "\n"


def _seed_text(seed_prefix: str) -> str:
    paths = sorted(SEEDS_DIR.glob(f"{seed_prefix}_*.txt"))
    if not paths:
        pytest.skip(f"seed {seed_prefix} is not in {SEEDS_DIR} (a checkout outside the project's workspace)")
    assert len(paths) == 1, f"several seeds start with {seed_prefix}: {paths}"
    return paths[0].read_text(encoding="utf-8")


def _ends_listing(line: str, end_marker: str | None) -> bool:
    if end_marker is not None:
        return end_marker in line
    return bool(line) and not line[0].isascii()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _compiles(source: str) -> bool:
    try:
        compile(source, "<listing>", "exec")
    except SyntaxError:
        return False
    return True
