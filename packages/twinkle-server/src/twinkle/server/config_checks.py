"""Checks of a server configuration's values: every problem found, each naming its key path.

:func:`config_problems` walks a config's data (native keys) against the option types of :data:`TOP`, then
checks values (ports, devices, back-ends, APIs, quotas, users and their API keys, key files) and returns
every problem at once, so ``twinkle server check-config`` can list them all (:mod:`twinkle.server.config`).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml

from twinkle.server.apis import installed_api_names
from twinkle.server.services.samplers import sampler_problems
from twinkle.server.services.trainers import backend_problems
from twinkle.server.store.base import check_user_name

MIN_API_KEY_LENGTH = 16  # keys are stored as a fast sha256, which is only safe for long random keys
DEVICE = re.compile(r"(cpu|cuda|npu|mps|xpu)(:\d+)?")

TOP: dict[str, type] = {
    "model_id": str,
    "host": str,
    "port": int,
    "device": str,
    "state_dir": str,
    "database": str,
    "checkpoint_dir": str,
    "max_loras": int,
    "max_rank": int,
    "backend": str,
    "gradient_checkpointing": bool,
    "kernels": bool,
    "record_routing": bool,
    "sampler": str,
    "sampler_args": dict,
    "max_tokens_per_pass": int,
    "max_tokens_per_sample_batch": int,
    "cycle_wait_s": float,
    "session_timeout_s": float,
    "checkpoint_sweep_interval_s": float,
    "tinker_chunk_datums": int,
    "apis": list,
    "api_keys_file": str,
    "ray": bool,
    "replicas": int,
    "users": dict,
    "quotas": dict,
}
NULLABLE = {"device", "database", "checkpoint_dir", "api_keys_file", "users", "apis", "sampler_args"}
PATHS = ("state_dir", "database", "checkpoint_dir", "api_keys_file")
QUOTAS: dict[str, type] = {
    "max_adapters": int,
    "max_rank": int,
    "max_tokens_per_request": int,
    "requests_per_second": float,
    "max_images_per_request": int,
    "max_image_bytes": int,
}
USER: dict[str, type] = {"api_keys": list, "quotas": dict}


def config_problems(data: dict[str, Any], base_dir: Path, defaults: dict[str, Any]) -> list[str]:
    """Every problem of a config's ``data`` (native keys; ``defaults``: the options' default values)."""
    data, problems = _shape(data, TOP, "", NULLABLE)  # from here on, every value has the right type
    merged = defaults | data
    if not 0 <= merged["port"] <= 65535:
        problems.append(f"port: must be in 0..65535 (0 lets the OS pick a free port), got {merged['port']}")
    for key in ("model_id", "host"):
        if not merged[key].strip():
            problems.append(f"{key}: must not be empty")
    if merged["device"] is not None and not DEVICE.fullmatch(merged["device"]):
        problems.append(f"device: {merged['device']!r} is not a device such as 'cpu', 'cuda' or 'cuda:1'")
    if merged["replicas"] != 1 and not merged["ray"]:
        problems.append(f"replicas: {merged['replicas']} replicas need ray: true (or --ray)")
    positive = ("max_loras", "max_rank", "session_timeout_s", "checkpoint_sweep_interval_s", "tinker_chunk_datums")
    for key in (*positive, "replicas"):
        if merged[key] <= 0:
            problems.append(f"{key}: must be positive, got {merged[key]}")
    if merged["max_tokens_per_pass"] < 0:
        problems.append(
            f"max_tokens_per_pass: must be >= 0 (0 never batches tenants together), got {merged['max_tokens_per_pass']}"
        )
    if merged["max_tokens_per_sample_batch"] < 0:
        problems.append(
            "max_tokens_per_sample_batch: must be >= 0 (0 samples one call at a time), got "
            f"{merged['max_tokens_per_sample_batch']}"
        )
    if merged["cycle_wait_s"] < 0:
        problems.append(f"cycle_wait_s: must be >= 0 (0 never waits for a pass to fill), got {merged['cycle_wait_s']}")
    problems += _api_problems(data.get("apis"))
    problems += backend_problems(merged["backend"], merged)
    problems += sampler_problems(merged["sampler"], merged["sampler_args"], merged["record_routing"])
    problems += _quota_problems(data.get("quotas") or {}, "quotas", merged["max_rank"])
    owners: dict[str, str] = {}
    for name, user in (data.get("users") or {}).items():
        problems += _user_problems(name, user, merged["max_rank"], owners)
    if data.get("api_keys_file") is not None:
        key_file = resolve_path(data["api_keys_file"], base_dir)
        from_file, file_problems = read_key_file(key_file)
        problems += file_problems
        for name, keys in from_file.items():
            problems += key_problems(name, keys, f"api_keys_file {key_file}: {name}", owners)
    return problems


def _shape(
    data: dict[str, Any], schema: dict[str, type], prefix: str, nullable: set[str]
) -> tuple[dict[str, Any], list[str]]:
    """The entries of ``data`` with known keys and right types, and a problem for each other entry."""
    good, problems = {}, []
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in schema:
            match = difflib.get_close_matches(str(key), list(schema), n=1)
            hint = f" (did you mean '{prefix}{match[0]}'?)" if match else f"; known keys: {', '.join(schema)}"
            problems.append(f"{where}: unknown key{hint}")
        elif (value is None and key in nullable) or _is_type(value, schema[key]):
            good[key] = value
        else:
            problems.append(f"{where}: expected {schema[key].__name__}, got {type(value).__name__} ({value!r})")
    return good, problems


def _is_type(value: Any, expected: type) -> bool:
    if isinstance(value, bool):
        return expected is bool
    if expected is float:
        return isinstance(value, (int, float))
    return isinstance(value, expected)


def _api_problems(apis: list[Any] | None) -> list[str]:
    installed = installed_api_names()
    problems = []
    for i, name in enumerate(apis or []):
        if not isinstance(name, str):
            problems.append(f"apis[{i}]: expected the name of a server API, got {type(name).__name__} ({name!r})")
        elif name not in installed:
            problems.append(f"apis[{i}]: no server API named {name!r}; installed: {', '.join(installed) or 'none'}")
    return problems


def _quota_problems(quotas: dict[str, Any], prefix: str, server_max_rank: int) -> list[str]:
    """An unset rank needs no check: ``quotas_for`` caps the default rank quota at the server's ``max_rank``."""
    quotas, problems = _shape(quotas, QUOTAS, f"{prefix}.", set())
    for key, value in quotas.items():
        if value <= 0:
            problems.append(f"{prefix}.{key}: must be positive, got {value}")
    rank = quotas.get("max_rank")
    if rank is not None and rank > server_max_rank:
        problems.append(f"{prefix}.max_rank: {rank} exceeds the server's max_rank {server_max_rank}")
    return problems


def _user_problems(name: Any, user: Any, server_max_rank: int, owners: dict[str, str]) -> list[str]:
    where = f"users.{name}"
    try:
        check_user_name(str(name))
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if user is None:
        return []
    if not isinstance(user, dict):
        return [f"{where}: expected a mapping with api_keys and/or quotas, got {type(user).__name__}"]
    user, problems = _shape(user, USER, f"{where}.", {"api_keys", "quotas"})
    problems += key_problems(name, user.get("api_keys") or [], f"{where}.api_keys", owners)
    return problems + _quota_problems(user.get("quotas") or {}, f"{where}.quotas", server_max_rank)


def key_problems(user: str, keys: list[Any], where: str, owners: dict[str, str]) -> list[str]:
    problems = []
    for i, key in enumerate(keys):
        if not isinstance(key, str):
            problems.append(f"{where}[{i}]: expected a string key, got {type(key).__name__}")
        elif len(key) < MIN_API_KEY_LENGTH or any(c.isspace() for c in key):
            problems.append(
                f"{where}[{i}]: API keys need at least {MIN_API_KEY_LENGTH} characters and no whitespace "
                f"(got {len(key)} characters); 'twinkle server add-user' generates good ones"
            )
        elif owners.setdefault(key, user) != user:
            problems.append(f"{where}[{i}]: key {key[:8]}... is already listed for user '{owners[key]}'")
    return problems


def read_key_file(path: Path) -> tuple[dict[str, list[str]], list[str]]:
    """``{user: [keys]}`` from a YAML or JSON file, and what is wrong with it."""
    where = f"api_keys_file {path}"
    if not path.is_file():
        return {}, [f"{where}: file does not exist"]
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as exc:
        return {}, [f"{where}: cannot be read: {exc}"]
    except yaml.YAMLError as exc:
        return {}, [f"{where}: not valid YAML/JSON: {exc}"]
    if not isinstance(data, dict):
        return {}, [f"{where}: must hold a mapping of user: [keys], got {type(data).__name__}"]
    keys, problems = {}, []
    for name, user_keys in data.items():
        try:
            check_user_name(str(name))
        except ValueError as exc:
            problems.append(f"{where}: {name}: {exc}")
            continue
        if not isinstance(user_keys, list):
            problems.append(f"{where}: {name}: expected a list of keys, got {type(user_keys).__name__}")
            continue
        keys[str(name)] = user_keys
    return keys, problems


def resolve_path(value: str, base_dir: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path
