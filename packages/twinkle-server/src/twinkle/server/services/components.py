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
# Methods whose first argument names a component, and the keyword it may also come as.
COMPONENT_ARGUMENTS = {
    "set_optimizer": "optimizer_cls",
    "set_lr_scheduler": "scheduler_cls",
    "set_loss": "loss",
    "set_template": "template",
    "set_processor": "processor",
}


def check_component_name(name: Any, what: str) -> str:
    """``name`` if it is a plain registered name, else an error saying what is allowed."""
    if not isinstance(name, str) or not _REGISTERED_NAME.fullmatch(name):
        raise InvalidInputError(
            f"{what} must be the registered name of a component (letters, digits, '_'), got {name!r}; "
            "import paths and objects cannot be sent to a server"
        )
    return name


def check_call_components(method: str, kwargs: dict[str, Any]) -> None:
    """Reject a ``set_*`` call whose component is not a plain registered name."""
    argument = COMPONENT_ARGUMENTS.get(method)
    if argument is not None:
        if argument not in kwargs:
            raise InvalidInputError(f"{method} needs {argument!r}, the registered name of the component")
        check_component_name(kwargs[argument], f"{method}({argument}=...)")
