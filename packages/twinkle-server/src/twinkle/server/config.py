"""Server configuration: dataclass defaults < YAML file < command-line overrides.

Every problem in a file is reported at once, each naming its key path
(``users.alice.quotas.max_rank``), so ``twinkle server check-config`` can list
them all before a deployment instead of failing on the first. Relative paths in
a file are resolved against the file's folder, so a config works from any cwd.
A file in seed 004's Ray Serve layout (``applications:``, ``http_options:``, ...)
is read as the native keys it means (:mod:`twinkle.server.config_layout`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from twinkle.errors import ConfigurationError
from twinkle.server.apis import installed_api_names
from twinkle.server.config_layout import from_applications_layout, uses_applications_layout
from twinkle.server.services.samplers import sampler_problems
from twinkle.server.services.trainers import backend_problems
from twinkle.server.store.base import check_user_name

DEFAULT_STATE_DIR = "~/.twinkle/server"
MIN_API_KEY_LENGTH = 16  # keys are stored as a fast sha256, which is only safe for long random keys
DEVICE = re.compile(r"(cpu|cuda|npu|mps|xpu)(:\d+)?")


@dataclass
class Quotas:
    """Per-user limits; ``ServerConfig.quotas`` holds the defaults, ``users.<name>.quotas`` overrides them."""

    max_adapters: int = 4
    max_rank: int = 64
    max_tokens_per_request: int = 65536
    requests_per_second: float = 50.0
    max_images_per_request: int = 64  # images in one training, encoding or sampling request
    max_image_bytes: int = 8 * 1024 * 1024  # one image as sent: its encoded file (PNG, JPEG, ...)


@dataclass
class UserConfig:
    """A user declared in the config: API keys and quota overrides (a subset of ``Quotas`` fields)."""

    api_keys: list[str] = field(default_factory=list)
    quotas: dict[str, float] = field(default_factory=dict)


@dataclass
class ServerConfig:
    """Everything ``twinkle server`` needs; ``database`` and ``checkpoint_dir`` default to inside ``state_dir``."""

    model_id: str = "builtin://qwen3-tiny"
    # The base model's device ("cpu", "cuda", "cuda:1", ...); None: a GPU when there is one, else the CPU.
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    # Both always hold a Path after __post_init__ (None means the default inside state_dir).
    database: Path = None  # type: ignore[assignment]
    checkpoint_dir: Path = None  # type: ignore[assignment]
    max_loras: int = 8
    max_rank: int = 64
    # The training back-end (services.trainers): "transformers" (the default) or "megatron" (megatron-core, extra
    # twinkle-model[megatron], on one device).
    backend: str = "transformers"
    # The base model's activation checkpointing (decoder layers recomputed in backward) and kernels (the model
    # family's Triton / NPU kernels, where the device runs them): TrainingModel's arguments of the same names.
    gradient_checkpointing: bool = False
    kernels: bool = False
    # MoE models: every sampler records each token's experts (``TorchSampler(record_routing=True)``), returned in
    # completions' ``new_input_feature["routed_experts"]``, which training calls replay (router replay).
    record_routing: bool = False
    # The sampler back-end (services.samplers): "torch" (TorchSampler, the default) or "vllm" (vLLMSampler, extra
    # twinkle-sampler[vllm]); sampler_args are its own options, e.g. {"engine_args": {...}, "async_engine": true}.
    sampler: str = "torch"
    sampler_args: dict[str, Any] = field(default_factory=dict)
    # Token budget of one shared training pass: the scheduler batches tenants' forward_backward calls
    # together up to this many input tokens (a single call bigger than it still runs, alone). 0 never
    # batches tenants together: every pass trains one request (for comparison, or strict isolation).
    max_tokens_per_pass: int = 32768
    # Budget of one batch of sample calls generated together, in token slots ((prompts + max_tokens) × samples
    # of each call, what its rows hold at most): it bounds how long a batch holds the model, and so how long
    # other calls wait behind it. Raise it on a GPU, where a decode step costs about the same for many rows.
    max_tokens_per_sample_batch: int = 8192
    # How long (idle) a shared pass may wait for the tenants of recent passes to send their next training
    # call (they are between round trips after their optimizer step), so that passes fill and tenants stay
    # in step. A tenant training alone never waits; 0 never waits.
    cycle_wait_s: float = 0.05
    session_timeout_s: float = 120.0
    # How often expired checkpoints (saved with a TTL) are deleted; an expired one is never served meanwhile.
    checkpoint_sweep_interval_s: float = 60.0
    # Tinker SDK clients split a forward_backward into requests of at most this many datums.
    tinker_chunk_datums: int = 1024
    # The API plugins served beside the native API (twinkle.server.apis), e.g. ["tinker"]; [] serves only the
    # native API; None (the default) every installed one whose dependencies are installed.
    apis: list[str] | None = None
    api_keys_file: Path | None = None
    # ``twinkle server --ray``: the model is a Ray Serve deployment of ``replicas`` replicas, each with the base
    # model and a share of the adapters; off, it runs in the server process.
    ray: bool = False
    replicas: int = 1
    users: dict[str, UserConfig] = field(default_factory=dict)
    quotas: Quotas = field(default_factory=Quotas)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir).expanduser()
        self.database = Path(self.database).expanduser() if self.database else self.state_dir / "twinkle.db"
        self.checkpoint_dir = (
            Path(self.checkpoint_dir).expanduser() if self.checkpoint_dir else self.state_dir / "checkpoints"
        )

    @property
    def model_options(self) -> dict[str, Any]:
        """What every model and sampler the server builds is built with (``ModelPool`` gives each its own)."""
        return {
            "backend": self.backend,
            "gradient_checkpointing": self.gradient_checkpointing,
            "kernels": self.kernels,
            "record_routing": self.record_routing,
            "sampler": self.sampler,
            "sampler_args": self.sampler_args,
        }

    def quotas_for(self, user: str) -> Quotas:
        """The server-wide defaults with ``user``'s overrides applied; a rank quota never exceeds ``max_rank``."""
        overrides = self.users[user].quotas if user in self.users else {}
        limits = dataclasses.replace(self.quotas, **overrides)  # type: ignore[arg-type]  # typed per field on load
        return dataclasses.replace(limits, max_rank=min(limits.max_rank, self.max_rank))

    def api_keys(self) -> dict[str, list[str]]:
        """Every configured key per user: inline ``users`` plus ``api_keys_file`` (read now, so edits apply).

        Raises ConfigurationError if the file is unreadable or a key is too short or listed for two users.
        """
        keys = {name: list(user.api_keys) for name, user in self.users.items()}
        from_file, problems = _read_key_file(self.api_keys_file) if self.api_keys_file is not None else ({}, [])
        for name, file_keys in from_file.items():
            keys.setdefault(name, []).extend(file_keys)
        owners: dict[str, str] = {}
        for name, user_keys in keys.items():
            problems += _key_problems(name, user_keys, f"api keys of user {name!r}", owners)
        if problems:
            raise ConfigurationError("; ".join(problems))
        return keys


_TOP: dict[str, type] = {
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
_NULLABLE = {"device", "database", "checkpoint_dir", "api_keys_file", "users", "apis", "sampler_args"}
_PATHS = ("state_dir", "database", "checkpoint_dir", "api_keys_file")
_QUOTAS: dict[str, type] = {
    "max_adapters": int,
    "max_rank": int,
    "max_tokens_per_request": int,
    "requests_per_second": float,
    "max_images_per_request": int,
    "max_image_bytes": int,
}
_USER: dict[str, type] = {"api_keys": list, "quotas": dict}


def load_config(path: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """Read ``path`` (or only defaults), apply non-None ``overrides`` (e.g. CLI flags), validate, build.

    Raises ConfigurationError listing every problem found.
    """
    unknown = sorted(set(overrides) - set(_TOP))
    if unknown:
        raise ConfigurationError(f"unknown server option(s) {unknown}; known: {sorted(_TOP)}")
    data, base_dir, problems = _read(Path(path)) if path is not None else ({}, Path.cwd(), [])
    data, layout_problems = _native(data)
    for key, value in overrides.items():
        if value is not None:  # flags are relative to the cwd, not to the config file
            data[key] = str(Path(value).expanduser().absolute()) if key in _PATHS else value
    problems = problems or layout_problems + _problems(data, base_dir)
    where = f"config {path}" if path is not None else "server options"
    if problems:
        raise ConfigurationError(f"{where} has {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return _build(data, base_dir)


def check_config(path: str | Path) -> list[str]:
    """Every problem in the config file at ``path``; an empty list means it loads."""
    data, base_dir, problems = _read(Path(path))
    data, layout_problems = _native(data)
    return problems or layout_problems + _problems(data, base_dir)


def _native(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` in native keys (a seed-004 layout translated), and what of the layout has no native form."""
    if not uses_applications_layout(data):
        return data, []
    return from_applications_layout(data, ServerConfig.model_id)


def _read(path: Path) -> tuple[dict[str, Any], Path, list[str]]:
    base_dir = path.parent.resolve()
    if not path.is_file():
        return {}, base_dir, [f"config file {path} does not exist"]
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as exc:
        return {}, base_dir, [f"config file {path} cannot be read: {exc}"]
    except yaml.YAMLError as exc:
        return {}, base_dir, [f"config file {path} is not valid YAML: {exc}"]
    if not isinstance(data, dict):
        return {}, base_dir, [f"config file {path} must hold a mapping of option: value, got {type(data).__name__}"]
    return data, base_dir, []


def _problems(data: dict[str, Any], base_dir: Path) -> list[str]:
    data, problems = _shape(data, _TOP, "", _NULLABLE)  # from here on, every value has the right type
    merged = dataclasses.asdict(ServerConfig()) | data
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
        key_file = _resolve(data["api_keys_file"], base_dir)
        from_file, file_problems = _read_key_file(key_file)
        problems += file_problems
        for name, keys in from_file.items():
            problems += _key_problems(name, keys, f"api_keys_file {key_file}: {name}", owners)
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
    quotas, problems = _shape(quotas, _QUOTAS, f"{prefix}.", set())
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
    user, problems = _shape(user, _USER, f"{where}.", {"api_keys", "quotas"})
    problems += _key_problems(name, user.get("api_keys") or [], f"{where}.api_keys", owners)
    return problems + _quota_problems(user.get("quotas") or {}, f"{where}.quotas", server_max_rank)


def _key_problems(user: str, keys: list[Any], where: str, owners: dict[str, str]) -> list[str]:
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


def _read_key_file(path: Path) -> tuple[dict[str, list[str]], list[str]]:
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


def _resolve(value: str, base_dir: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


def _build(data: dict[str, Any], base_dir: Path) -> ServerConfig:
    values = dict(data)
    for key in _PATHS:
        if values.get(key) is not None:
            values[key] = _resolve(values[key], base_dir)
    values["sampler_args"] = dict(values.get("sampler_args") or {})
    values["quotas"] = Quotas(**_typed_quotas(values.get("quotas") or {}))
    values["users"] = {
        str(name): UserConfig(list((user or {}).get("api_keys") or []), _typed_quotas((user or {}).get("quotas") or {}))
        for name, user in (values.get("users") or {}).items()
    }
    for key in ("session_timeout_s", "checkpoint_sweep_interval_s"):  # YAML ``60`` is an int
        values[key] = float(values.get(key, getattr(ServerConfig, key)))
    return ServerConfig(**values)


def _typed_quotas(quotas: dict[str, Any]) -> dict[str, Any]:
    """YAML ``requests_per_second: 5`` is an int; the dataclass promises a float."""
    return {key: _QUOTAS[key](value) for key, value in quotas.items()}
