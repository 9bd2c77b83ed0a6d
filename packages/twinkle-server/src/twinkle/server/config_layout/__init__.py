"""Seed 004's ``server_config.yaml`` layout (Ray Serve ``applications``), read as this server's options.

That layout runs a gateway, a model, a sampler and a processor as separate Ray
Serve applications. This server is one HTTP process serving both APIs, and it
samples and processes data next to its model (the sampler in each replica under
``ray: true``), so a layout means a few native keys:

- ``http_options.host`` / ``.port`` (also in the gateway's ``args``): ``host`` / ``port``
- the model's ``args.model_id`` / ``args.max_loras``: ``model_id`` / ``max_loras``
- ``use_megatron`` (top level or the model's ``args``) / the model's ``args.backend``: ``backend``
  (``megatron`` or ``transformers``)
- the model's ``deployments[0].num_replicas`` (or a fixed ``autoscaling_config``): ``replicas``,
  and ``ray: true`` for more than one
- ``device_type`` of the model's (and sampler's) ``device_group`` / ``device_mesh``: ``device``
- the gateway's ``server_config.per_token_model_limit``: ``quotas.max_adapters`` (per user)
- the sampler's ``args.sampler_type`` (``torch`` or ``vllm``) / ``args.engine_args``: ``sampler`` /
  ``sampler_args.engine_args``
- ``task_queue`` (or an application's ``queue_config``) ``rps_limit`` / ``max_input_tokens``:
  ``quotas.requests_per_second`` / ``quotas.max_tokens_per_request`` (per user)

Accepted as they are what this server does anyway: one device per model copy,
``proxy_location`` ``HeadOnly`` or ``EveryNode`` (one HTTP front, on one node),
a disabled ``telemetry``, ``persistence.mode: memory`` (state is kept in SQLite
under ``state_dir``, so it also survives a restart), names, and the route
prefixes of the model, sampler and processor applications (internal to that
layout). Any other key is a problem naming its path and why: not available
yet, or the native key to use instead. Native keys
(``state_dir``, ``users``, ...) may sit next to the layout; a key set by both must agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from twinkle.server.config_layout import top_level
from twinkle.server.config_layout.applications import applications, check_models
from twinkle.server.config_layout.reader import LayoutReader

_READERS: dict[str, Callable[[LayoutReader, Any, str], None]] = {
    "applications": applications,
    "http_options": top_level.http_options,
    "proxy_location": top_level.proxy_location,
    "ray_namespace": top_level.ray_namespace,
    "persistence": top_level.persistence,
    "telemetry": top_level.telemetry,
    "task_queue": top_level.task_queue,
    "use_megatron": top_level.use_megatron,
}
LAYOUT_KEYS = tuple(_READERS)


def uses_applications_layout(data: Mapping[str, Any]) -> bool:
    return any(key in data for key in LAYOUT_KEYS)


def from_applications_layout(data: Mapping[str, Any], default_model_id: str) -> tuple[dict[str, Any], list[str]]:
    """The native options a layout config means, and a problem (``key.path: why``) for each key it cannot mean."""
    reader = LayoutReader({key: value for key, value in data.items() if key not in _READERS})
    for key, value in data.items():
        if key in _READERS:
            _READERS[key](reader, value, key)
    check_models(reader, reader.native.get("model_id", default_model_id))
    return reader.native, reader.problems
