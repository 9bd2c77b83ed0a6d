"""Interfaces of infrastructure components: persistent Store and compute Kernel."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Store(Protocol):
    """Durable key → JSON-document storage in named tables (SQLite by default)."""

    def get(self, table: str, key: str) -> dict[str, Any] | None: ...

    def put(self, table: str, key: str, value: dict[str, Any]) -> None: ...

    def delete(self, table: str, key: str) -> bool: ...

    def scan(self, table: str, prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]: ...


@runtime_checkable
class Kernel(Protocol):
    """An optimised implementation of an operation, used only where it is available."""

    name: str

    def is_available(self, device_type: str) -> bool: ...
