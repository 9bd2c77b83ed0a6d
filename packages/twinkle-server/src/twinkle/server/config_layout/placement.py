"""Where an application runs: its devices (``device_group``, ``device_mesh``) and its Ray Serve deployment."""

from __future__ import annotations

from typing import Any

from twinkle.server.config_layout.reader import ONE_DEVICE, LayoutReader

DEVICE_TYPES = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "npu": "npu", "mps": "mps"}
_GROUP = ("name", "ranks", "device_type", "gpus_per_worker")
_REPLICA_COUNTS = ("min_replicas", "max_replicas", "initial_replicas")
_AUTOSCALING_TUNING = {
    "target_ongoing_requests",
    "metrics_interval_s",
    "look_back_period_s",
    "smoothing_factor",
    "upscale_smoothing_factor",
    "downscale_smoothing_factor",
    "upscaling_factor",
    "downscaling_factor",
    "upscale_delay_s",
    "downscale_delay_s",
    "downscale_to_zero_delay_s",
    "aggregation_function",
    "policy",
}
_SERVE_OPTIONS = {
    "ray_actor_options",
    "max_ongoing_requests",
    "max_queued_requests",
    "user_config",
    "health_check_period_s",
    "health_check_timeout_s",
    "graceful_shutdown_wait_loop_s",
    "graceful_shutdown_timeout_s",
    "logging_config",
    "placement_group_bundles",
    "placement_group_strategy",
    "max_replicas_per_node",
    "request_router_config",
}


def devices(r: LayoutReader, args: dict[str, Any], where: str) -> str | None:
    """Check that ``args`` place one model copy on one device; the device type they name (``cpu``, ``cuda``, ...)."""
    r.one(args.get("nproc_per_node"), f"{where}.nproc_per_node")
    types: dict[str, Any] = {}
    for key, value in r.mapping(args.get("device_group"), f"{where}.device_group").items():
        at = f"{where}.device_group.{key}"
        if key == "ranks":
            if isinstance(value, list) and len(value) == 1 and value[0] != 0:
                r.problem(at, f"{value}: pick the device with device: 'cuda:{value[0]}' instead")
            elif value != [0]:
                r.one(len(value) if isinstance(value, list) else value, at)
        elif key == "gpus_per_worker":
            r.one(value, at)
        elif key == "device_type":
            types[at] = value
        elif key == "visible_devices":
            r.problem(at, "not supported: set CUDA_VISIBLE_DEVICES for the server, or device: 'cuda:N'")
        elif key != "name":
            r.unknown(key, _GROUP, f"{where}.device_group")
    for key, value in r.mapping(args.get("device_mesh"), f"{where}.device_mesh").items():
        at = f"{where}.device_mesh.{key}"
        if key.endswith("_size"):
            r.one(value, at)
        elif key == "device_type":
            types[at] = value
        elif key in ("mesh", "mesh_dim_names") or (key == "sequence_parallel" and value):
            r.problem(at, ONE_DEVICE)
        elif key != "sequence_parallel":
            r.unknown(key, ("device_type", "dp_size", "fsdp_size", "tp_size"), f"{where}.device_mesh")
    device = None
    for at, value in types.items():
        named = DEVICE_TYPES.get(str(value).lower())
        if named is None:
            r.problem(at, f"{value!r}: one of {', '.join(DEVICE_TYPES)}")
        elif device is not None and named != device:
            r.problem(at, f"{value!r} disagrees with the device_group's device_type")
        else:
            device = named
    return device


def replica_count(r: LayoutReader, value: Any, where: str) -> int | None:
    """The number of replicas the (one) deployment in ``value`` fixes, if it sets one."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        r.problem(where, f"expected a list of Ray Serve deployments, got {type(value).__name__}")
        return None
    if len(value) > 1:
        r.problem(where, f"{len(value)} deployments: an application here has one")
    at = f"{where}[0]"
    counts: list[int] = []
    for key, item in r.mapping(value[0], at).items():
        if key == "num_replicas":
            if r.typed(item, int, f"{at}.num_replicas"):
                counts.append(item)
        elif key == "autoscaling_config":
            counts += _fixed_replicas(r, r.mapping(item, f"{at}.{key}"), f"{at}.{key}")
        elif key in _SERVE_OPTIONS:
            r.problem(f"{at}.{key}", "not supported: the server sets its Ray Serve options itself")
        elif key != "name":
            r.unknown(key, ("name", "num_replicas", "autoscaling_config", *sorted(_SERVE_OPTIONS)), at)
    if len(set(counts)) > 1:
        r.problem(at, f"replica counts {counts} disagree: autoscaling is not supported, fix one number")
        return None
    if counts and counts[0] < 1:
        r.problem(at, f"replicas must be positive, got {counts[0]}")
        return None
    return counts[0] if counts else None


def _fixed_replicas(r: LayoutReader, config: dict[str, Any], where: str) -> list[int]:
    counts = []
    for key, value in config.items():
        if key in _REPLICA_COUNTS:
            if r.typed(value, int, f"{where}.{key}"):
                counts.append(value)
        elif key not in _AUTOSCALING_TUNING:  # the tuning keys are inert when the count is fixed
            r.unknown(key, (*_REPLICA_COUNTS, *sorted(_AUTOSCALING_TUNING)), where)
    if len(set(counts)) > 1:
        r.problem(where, "autoscaling is not supported: fix the replica count (min_replicas = max_replicas)")
        return []
    return counts[:1]
