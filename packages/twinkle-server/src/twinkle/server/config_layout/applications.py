"""The layout's ``applications``: a gateway (``server``), a ``model``, a ``sampler`` and a ``processor``."""

from __future__ import annotations

from typing import Any

from twinkle.server.config_layout.placement import devices, replica_count
from twinkle.server.config_layout.reader import LayoutReader
from twinkle.server.config_layout.top_level import http_options, task_queue, use_megatron

KINDS = ("server", "model", "sampler", "processor")
TINKER_PREFIX = "/api/v1"
_APPLICATION = ("name", "route_prefix", "import_path", "args", "deployments")
_PLACEMENT = ("nproc_per_node", "device_group", "device_mesh")


def applications(r: LayoutReader, value: Any, where: str) -> None:
    if not isinstance(value, list):
        r.problem(where, f"expected a list of applications, got {type(value).__name__}")
        return
    r.has_applications = True
    for index, application in enumerate(value):
        _application(r, application, f"{where}[{index}]")


def check_models(r: LayoutReader, model_id: str) -> None:
    """Once every application is read: they all name the one base model, ``model_id``."""
    if r.has_applications and "model" not in r.kinds and "model_id" not in r.native:
        r.problem("applications", "no model application (import_path: model) to name the base model")
    if r.sampler_model is not None and r.sampler_model[1] != model_id:
        at, sampled = r.sampler_model
        r.problem(at, f"{sampled!r}: the server samples the model it trains, {model_id!r}")
    at, names = r.supported_models or ("", [])
    for index, name in enumerate(names):
        if name != model_id:
            r.problem(
                f"{at}[{index}]",
                f"{name!r}: the server hosts one base model, {model_id!r}; Tinker clients name it by that id "
                "(or by its local folder)",
            )


def _application(r: LayoutReader, application: Any, where: str) -> None:
    spec = r.mapping(application, where)
    for key in spec.keys() - set(_APPLICATION):
        r.unknown(key, _APPLICATION, where)
    kind = spec.get("import_path")
    if kind not in KINDS:
        r.problem(f"{where}.import_path", f"{kind!r}: one of {', '.join(KINDS)} (the server imports no other code)")
        return
    if kind in r.kinds:
        r.problem(where, f"a second {kind} application (the first is {r.kinds[kind]}): one of each here")
        return
    r.kinds[kind] = where
    if "name" in spec:
        r.typed(spec["name"], str, f"{where}.name")
    if kind == "server" and spec.get("route_prefix", TINKER_PREFIX) != TINKER_PREFIX:
        r.problem(
            f"{where}.route_prefix", f"the Tinker API is served at {TINKER_PREFIX} (the native one at /twinkle/v1)"
        )
    args = r.mapping(spec.get("args"), f"{where}.args")
    _READERS[kind](r, args, f"{where}.args")
    replicas = replica_count(r, spec.get("deployments"), f"{where}.deployments")
    if replicas is None:
        return
    if kind == "model":
        r.assign("replicas", replicas, f"{where}.deployments")
        if replicas > 1 and "ray" not in r.set_by:
            r.assign("ray", True, f"{where}.deployments")
    elif replicas != 1:
        r.problem(
            f"{where}.deployments",
            f"the {kind} runs in the server (the sampler next to each model replica): only the model has replicas",
        )


def _server_args(r: LayoutReader, args: dict[str, Any], where: str) -> None:
    for key, value in args.items():
        at = f"{where}.{key}"
        if key == "server_config":
            _gateway_state(r, r.mapping(value, at), at)
        elif key == "supported_models":
            if r.typed(value, list, at):
                r.supported_models = (at, value)
        elif key == "http_options":
            http_options(r, value, at)
        elif key == "route_prefix":
            if value != TINKER_PREFIX:
                r.problem(at, f"the Tinker API is served at {TINKER_PREFIX}")
        else:
            r.unknown(key, ("server_config", "supported_models", "http_options", "route_prefix"), where)


def _gateway_state(r: LayoutReader, settings: dict[str, Any], where: str) -> None:
    for key, value in settings.items():
        at = f"{where}.{key}"
        if key == "per_token_model_limit":
            if r.typed(value, int, at):
                r.assign("quotas.max_adapters", value, at)
        elif key == "expiration_timeout":
            r.problem(at, "not supported: a session ends session_timeout_s after its last heartbeat")
        elif key in ("cleanup_interval", "metrics_update_interval", "actor_name"):
            r.problem(at, "not supported: the server has no such setting")
        else:
            r.unknown(key, ("per_token_model_limit", "expiration_timeout", "cleanup_interval"), where)


def _model_args(r: LayoutReader, args: dict[str, Any], where: str) -> None:
    _device(r, args, where)
    for key, value in args.items():
        at = f"{where}.{key}"
        if key in ("model_id", "max_loras"):
            if r.typed(value, str if key == "model_id" else int, at):
                r.assign(key, value, at)
        elif key == "backend":
            if value in ("transformers", "megatron"):
                r.assign("backend", value, at)
            else:
                r.problem(at, f"{value!r}: the server trains with backend: transformers or backend: megatron")
        elif key == "use_megatron":
            use_megatron(r, value, at)
        elif key == "train_mode":
            if value != "lora":
                r.problem(
                    at,
                    f"{value!r}: not a server-wide mode here: a run created without a LoRA config trains "
                    "all parameters, the others train LoRA adapters",
                )
        elif key == "queue_config":
            task_queue(r, value, at)
        elif key == "adapter_config":
            r.problem(at, "not supported: a run's adapter is unloaded when its session ends (session_timeout_s)")
        elif key == "max_length":
            r.problem(
                at,
                "not supported: sequences may be as long as the model takes; quotas.max_tokens_per_request "
                "limits a request",
            )
        elif key not in _PLACEMENT:
            r.unknown(key, ("model_id", "max_loras", "backend", *_PLACEMENT, "queue_config"), where)


def _sampler_args(r: LayoutReader, args: dict[str, Any], where: str) -> None:
    _device(r, args, where)
    for key, value in args.items():
        at = f"{where}.{key}"
        if key == "model_id":
            if r.typed(value, str, at):
                r.sampler_model = (at, value)
        elif key == "sampler_type":
            if value in ("torch", "vllm"):
                r.assign("sampler", value, at)
            else:
                r.problem(at, f"{value!r}: the server samples with torch or vllm (sampler_type: torch | vllm)")
        elif key == "engine_args":
            if r.typed(value, dict, at):
                r.assign("sampler_args.engine_args", value, at)
        elif key == "queue_config":
            task_queue(r, value, at)
        elif key not in _PLACEMENT:
            r.unknown(key, ("model_id", "sampler_type", *_PLACEMENT, "queue_config"), where)


def _processor_args(r: LayoutReader, args: dict[str, Any], where: str) -> None:
    device = devices(r, args, where)
    if device not in (None, "cpu"):
        r.problem(where, f"datasets are processed on the CPU, in the server process (got device_type {device!r})")
    for key, value in args.items():
        at = f"{where}.{key}"
        if key == "ncpu_proc_per_node":
            if r.typed(value, int, at) and value != 1:
                r.problem(
                    at,
                    "not supported: datasets are processed in the server process (a client's "
                    "map(..., num_proc=N) uses N processes)",
                )
        elif key == "queue_config":
            task_queue(r, value, at)
        elif key not in ("device_group", "device_mesh"):
            r.unknown(key, ("ncpu_proc_per_node", "device_group", "device_mesh", "queue_config"), where)


def _device(r: LayoutReader, args: dict[str, Any], where: str) -> None:
    """The model and the sampler (which runs next to it) name the native ``device``; they must agree."""
    device = devices(r, args, where)
    if device is not None:
        r.assign("device", device, f"{where}.device_group")


_READERS = {"server": _server_args, "model": _model_args, "sampler": _sampler_args, "processor": _processor_args}
