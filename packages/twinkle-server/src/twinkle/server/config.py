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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from twinkle.errors import ConfigurationError
from twinkle.server.config_checks import (
    PATHS,
    QUOTAS,
    TOP,
    config_problems,
    key_problems,
    read_key_file,
    resolve_path,
)
from twinkle.server.config_layout import from_applications_layout, uses_applications_layout

DEFAULT_STATE_DIR = "~/.twinkle/server"


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
        from_file, problems = read_key_file(self.api_keys_file) if self.api_keys_file is not None else ({}, [])
        for name, file_keys in from_file.items():
            keys.setdefault(name, []).extend(file_keys)
        owners: dict[str, str] = {}
        for name, user_keys in keys.items():
            problems += key_problems(name, user_keys, f"api keys of user {name!r}", owners)
        if problems:
            raise ConfigurationError("; ".join(problems))
        return keys


def load_config(path: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """Read ``path`` (or only defaults), apply non-None ``overrides`` (e.g. CLI flags), validate, build.

    Raises ConfigurationError listing every problem found.
    """
    unknown = sorted(set(overrides) - set(TOP))
    if unknown:
        raise ConfigurationError(f"unknown server option(s) {unknown}; known: {sorted(TOP)}")
    data, base_dir, problems = _read(Path(path)) if path is not None else ({}, Path.cwd(), [])
    data, layout_problems = _native(data)
    for key, value in overrides.items():
        if value is not None:  # flags are relative to the cwd, not to the config file
            data[key] = str(Path(value).expanduser().absolute()) if key in PATHS else value
    problems = problems or layout_problems + config_problems(data, base_dir, dataclasses.asdict(ServerConfig()))
    where = f"config {path}" if path is not None else "server options"
    if problems:
        raise ConfigurationError(f"{where} has {len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    return _build(data, base_dir)


def check_config(path: str | Path) -> list[str]:
    """Every problem in the config file at ``path``; an empty list means it loads."""
    data, base_dir, problems = _read(Path(path))
    data, layout_problems = _native(data)
    return problems or layout_problems + config_problems(data, base_dir, dataclasses.asdict(ServerConfig()))


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


def _build(data: dict[str, Any], base_dir: Path) -> ServerConfig:
    values = dict(data)
    for key in PATHS:
        if values.get(key) is not None:
            values[key] = resolve_path(values[key], base_dir)
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
    return {key: QUOTAS[key](value) for key, value in quotas.items()}
