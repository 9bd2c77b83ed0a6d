"""What reading a layout config keeps: the native options so far, the problems, and checks that report them."""

from __future__ import annotations

import difflib
from typing import Any

ONE_DEVICE = (
    "a model spread over several devices is not available in the server yet; for several copies of the model, "
    "each with a share of the adapters, set the model application's deployments[0].num_replicas"
)


class LayoutReader:
    """The native options (``native``) a layout config means so far, and its problems (``where: why``)."""

    def __init__(self, native: dict[str, Any]) -> None:
        quotas = native.get("quotas")
        self.native = {**native, "quotas": dict(quotas)} if isinstance(quotas, dict) else dict(native)
        self.problems: list[str] = []
        self.set_by = {key: key for key in native}  # native key -> where its value came from
        self.set_by.update({f"quotas.{key}": f"quotas.{key}" for key in (quotas if isinstance(quotas, dict) else {})})
        self.kinds: dict[str, str] = {}  # application kind -> where that application is
        self.has_applications = False
        self.supported_models: tuple[str, list[Any]] | None = None  # (where, names)
        self.sampler_model: tuple[str, str] | None = None  # (where, model id)

    def assign(self, key: str, value: Any, where: str) -> None:
        """Native ``key`` (``quotas.<name>`` for a quota) is ``value``, unless something set it differently."""
        section, _, name = key.rpartition(".")
        target = self.native.setdefault(section, {}) if section else self.native
        if not isinstance(target, dict):
            return  # a malformed native section: the native checks report it
        if name in target and target[name] != value:
            self.problem(where, f"{value!r} disagrees with {self.set_by[key]} ({target[name]!r}); set it once")
            return
        target[name] = value
        self.set_by.setdefault(key, where)

    def problem(self, where: str, why: str) -> None:
        self.problems.append(f"{where}: {why}")

    def mapping(self, value: Any, where: str) -> dict[str, Any]:
        """``value`` if it is a mapping (``{}`` for none); else a problem and ``{}``."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problem(where, f"expected a mapping, got {type(value).__name__} ({value!r})")
            return {}
        return value

    def typed(self, value: Any, expected: type, where: str) -> bool:
        """Whether ``value`` is an ``expected`` (an int counts as a float, a bool as nothing else); else a problem."""
        accepted = (int, float) if expected is float else expected
        ok = isinstance(value, accepted) and (expected is bool or not isinstance(value, bool))
        if not ok:
            self.problem(where, f"expected {expected.__name__}, got {type(value).__name__} ({value!r})")
        return ok

    def unknown(self, key: str, known: set[str] | tuple[str, ...], where: str) -> None:
        match = difflib.get_close_matches(str(key), list(known), n=1)
        self.problem(f"{where}.{key}", f"unknown key (did you mean '{match[0]}'?)" if match else "unknown key")

    def one(self, value: Any, where: str) -> None:
        """A count of devices or processes for one model copy: 1 (or unset)."""
        if value is not None and self.typed(value, int, where) and value != 1:
            self.problem(where, ONE_DEVICE)
