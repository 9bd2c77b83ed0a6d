"""What tenants may name: registered components only, never an import path.

``twinkle.registry.build`` also accepts ``"package.module:Name"``, which
imports and calls arbitrary code: fine in-process, a remote-code-execution
hole on a server. Every component a tenant names goes through here.
"""

from __future__ import annotations

import re
from typing import Any

from twinkle.errors import InvalidInputError

REGISTERED_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,99}$"
_REGISTERED_NAME = re.compile(REGISTERED_NAME)


def check_component_name(name: Any, what: str) -> str:
    """``name`` if it is a plain registered name, else an error saying what is allowed."""
    if not isinstance(name, str) or not _REGISTERED_NAME.fullmatch(name):
        raise InvalidInputError(
            f"{what} must be the registered name of a component (letters, digits, '_'), got {name!r}; "
            "import paths and objects cannot be sent to a server"
        )
    return name
