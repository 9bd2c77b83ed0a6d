"""The layout's top-level keys other than ``applications``; ``task_queue`` also reads applications' queues."""

from __future__ import annotations

from typing import Any

from twinkle.server.config_layout.reader import LayoutReader

_TELEMETRY = ("enabled", "service_name", "otlp_endpoint", "debug", "export_interval_ms", "resource_attributes")
_PERSISTENCE = ("mode", "file_path", "redis_url", "key_prefix")


def http_options(r: LayoutReader, value: Any, where: str) -> None:
    for key, item in r.mapping(value, where).items():
        if key in ("host", "port"):
            if r.typed(item, str if key == "host" else int, f"{where}.{key}"):
                r.assign(key, item, f"{where}.{key}")
        else:
            r.problem(f"{where}.{key}", "not supported: the server listens on host and port only")


def proxy_location(r: LayoutReader, value: Any, where: str) -> None:
    if value not in ("HeadOnly", "EveryNode"):
        r.problem(where, f"{value!r} not supported: the server is its own HTTP front (HeadOnly or EveryNode)")


def ray_namespace(r: LayoutReader, value: Any, where: str) -> None:
    r.problem(where, "not supported: under ray: true the server's Ray applications use a namespace of their own")


def telemetry(r: LayoutReader, value: Any, where: str) -> None:
    for key, item in r.mapping(value, where).items():
        if key not in _TELEMETRY:
            r.unknown(key, _TELEMETRY, where)
        elif key == "enabled" and item:
            r.problem(f"{where}.enabled", "OpenTelemetry export is not available; metrics are at /metrics (Prometheus)")


def persistence(r: LayoutReader, value: Any, where: str) -> None:
    settings = r.mapping(value, where)
    mode = settings.get("mode", "memory")
    if mode == "file":
        r.problem(f"{where}.mode", "'file': the server keeps its state in SQLite; set database: PATH instead")
    elif mode == "redis":
        r.problem(f"{where}.mode", "'redis' is not available: the server keeps its state in SQLite (database:)")
    elif mode != "memory":
        r.problem(f"{where}.mode", f"{mode!r}: one of memory, file, redis")
    for key in settings.keys() - set(_PERSISTENCE):
        r.unknown(key, _PERSISTENCE, where)


def task_queue(r: LayoutReader, value: Any, where: str) -> None:
    """Rate limits, per user here (quotas), from ``task_queue`` or an application's ``queue_config``."""
    for key, item in r.mapping(value, where).items():
        at = f"{where}.{key}"
        if key == "rps_limit":
            if r.typed(item, float, at):
                r.assign("quotas.requests_per_second", float(item), at)
        elif key == "max_input_tokens":
            if r.typed(item, int, at):
                r.assign("quotas.max_tokens_per_request", item, at)
        elif key == "enabled":
            if item is not True:
                r.problem(at, "rate limits cannot be turned off; raise quotas.requests_per_second instead")
        elif key == "tps_limit":
            r.problem(at, "no token-rate limit yet; quotas.max_tokens_per_request limits one request's tokens")
        else:
            r.problem(at, "not supported: the server's queues keep calls until they run, in order")


def use_megatron(r: LayoutReader, value: Any, where: str) -> None:
    if r.typed(value, bool, where):
        r.assign("backend", "megatron" if value else "transformers", where)
