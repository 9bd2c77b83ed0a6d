"""Twinkle: post-training of large language models over semantic calls.

``twinkle`` is a namespace spread over many distributions (``twinkle-core``,
``twinkle-dataset``, ``twinkle-model``, ...). This file is owned by
``twinkle-core``; ``extend_path`` lets every other distribution add its
sub-package, for normal installs (one merged folder) and editable installs
(one ``src/`` path entry per distribution) alike.
"""

from __future__ import annotations

import importlib
from pkgutil import extend_path
from typing import TYPE_CHECKING, Any

__path__ = extend_path(__path__, __name__)
__version__ = "0.1.0"

# Public names re-exported lazily so ``import twinkle`` stays cheap.
_LAZY_EXPORTS = {
    "initialize": "twinkle.infra",
    "get_device_placement": "twinkle.infra",
    "is_master": "twinkle.infra",
    "DeviceMesh": "twinkle.infra.device_mesh",
    "DeviceGroup": "twinkle.infra.device_mesh",
    "get_logger": "twinkle.utils.logging",
    "seed_everything": "twinkle.utils.seed",
    "init_twinkle_client": "twinkle_client",
    "init_tinker_client": "twinkle_client",
}

__all__ = [
    "DeviceGroup",
    "DeviceMesh",
    "get_device_placement",
    "get_logger",
    "init_tinker_client",
    "init_twinkle_client",
    "initialize",
    "is_master",
    "seed_everything",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from twinkle.infra import get_device_placement, initialize, is_master
    from twinkle.infra.device_mesh import DeviceGroup, DeviceMesh
    from twinkle.utils.logging import get_logger
    from twinkle.utils.seed import seed_everything


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'twinkle' has no attribute {name!r}")
    if module_name == "twinkle_client":
        from twinkle.utils.imports import require

        module = require("twinkle_client", "twinkle-client", f"twinkle.{name}")
    else:
        module = importlib.import_module(module_name)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
