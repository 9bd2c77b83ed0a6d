"""Seed 004's Ray Serve ``applications`` layout: what maps onto native keys, and a named problem for the rest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from twinkle.errors import ConfigurationError
from twinkle.server.config import Quotas, check_config, load_config
from twinkle.server.config_layout import from_applications_layout

LAYOUT = """
proxy_location: EveryNode
http_options: {host: 127.0.0.1, port: 8123}
telemetry: {enabled: false, otlp_endpoint: http://localhost:4317}
persistence: {mode: memory}
task_queue: {rps_limit: 20, max_input_tokens: 4096}
state_dir: state
applications:
  - name: server
    route_prefix: /api/v1
    import_path: server
    args:
      server_config: {per_token_model_limit: 3}
      supported_models: [builtin://qwen3-tiny]
    deployments:
      - name: GatewayServer
        autoscaling_config: {min_replicas: 1, max_replicas: 1, target_ongoing_requests: 128}
  - name: models-qwen3-tiny
    route_prefix: /api/v1/model/qwen3-tiny
    import_path: model
    args:
      backend: transformers
      model_id: builtin://qwen3-tiny
      max_loras: 6
      nproc_per_node: 1
      device_group: {name: model, ranks: 1, device_type: cpu}
      device_mesh: {device_type: cpu, dp_size: 1}
    deployments:
      - name: ModelManagement
        num_replicas: 2
  - name: sampler-qwen3-tiny
    route_prefix: /api/v1/sampler/qwen3-tiny
    import_path: sampler
    args:
      model_id: builtin://qwen3-tiny
      sampler_type: torch
      device_group: {name: sampler, ranks: 1, device_type: CPU}
      device_mesh: {device_type: cpu, dp_size: 1}
  - name: processor
    import_path: processor
    args: {}
"""


def _write(tmp_path: Path, data: dict | str) -> Path:
    path = tmp_path / "server_config.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _layout() -> dict:
    return yaml.safe_load(LAYOUT)


def _has(problems: list[str], start: str) -> bool:
    return any(problem.startswith(start) for problem in problems)


def _app(data: dict, kind: str) -> dict:
    return next(app for app in data["applications"] if app["import_path"] == kind)


def test_the_layout_maps_onto_native_keys(tmp_path):
    path = _write(tmp_path, LAYOUT)
    assert check_config(path) == []
    config = load_config(path)
    assert (config.model_id, config.host, config.port) == ("builtin://qwen3-tiny", "127.0.0.1", 8123)
    assert config.max_loras == 6
    assert (config.replicas, config.ray, config.device) == (2, True, "cpu")  # 2 replicas are Ray Serve's
    assert config.quotas == Quotas(max_adapters=3, max_rank=64, max_tokens_per_request=4096, requests_per_second=20.0)
    assert config.state_dir == tmp_path / "state"  # native keys sit next to the layout
    assert load_config(path, port=0, replicas=1).port == 0  # flags still override the file


def test_one_model_replica_runs_in_the_server_process(tmp_path):
    data = _layout()
    _app(data, "model")["deployments"] = [{"name": "ModelManagement", "num_replicas": 1}]
    config = load_config(_write(tmp_path, data))
    assert (config.replicas, config.ray) == (1, False)
    data["ray"] = True  # a one-replica Serve deployment, when asked for
    assert load_config(_write(tmp_path, data)).ray is True


def test_use_megatron_and_backend_megatron_mean_backend_megatron_and_must_agree(tmp_path):
    data = _layout()
    data["use_megatron"] = True
    _app(data, "model")["args"]["backend"] = "megatron"
    assert check_config(_write(tmp_path, data)) == []
    assert load_config(_write(tmp_path, data)).backend == "megatron"
    data["use_megatron"] = False  # and the model's backend: megatron
    problems = check_config(_write(tmp_path, data))
    assert _has(problems, "use_megatron: 'transformers' disagrees with applications[1].args.backend ('megatron')")
    del data["use_megatron"]
    _app(data, "model")["args"]["backend"] = "deepspeed"
    assert _has(check_config(_write(tmp_path, data)), "applications[1].args.backend: 'deepspeed': the server trains")


def test_a_vllm_sampler_application_means_sampler_vllm_with_its_engine_args(tmp_path):
    data = _layout()
    sampler = _app(data, "sampler")["args"]
    sampler["sampler_type"] = "vllm"
    sampler["engine_args"] = {"gpu_memory_utilization": 0.5}
    native, problems = from_applications_layout(data, "builtin://qwen3-tiny")
    assert (native["sampler"], native["sampler_args"]) == ("vllm", {"engine_args": {"gpu_memory_utilization": 0.5}})
    assert problems == []
    if importlib.util.find_spec("vllm") is None:  # this venv: the config names the extra to install
        assert check_config(_write(tmp_path, data)) == [
            "sampler: 'vllm' needs vLLM, which is not installed: pip install 'twinkle-sampler[vllm]' "
            "(or use sampler: torch)"
        ]


def test_every_unsupported_key_is_a_problem_naming_its_path(tmp_path):
    data = _layout()
    data["ray_namespace"] = "twinkle_cluster"
    data["persistence"] = {"mode": "redis", "redis_url": "redis://localhost"}
    data["telemetry"]["enabled"] = True
    data["task_queue"]["tps_limit"] = 1000
    model = _app(data, "model")
    model["args"]["device_group"]["ranks"] = 8
    model["args"]["device_mesh"]["fsdp_size"] = 4
    model["args"]["adapter_config"] = {"adapter_timeout": 30}
    model["args"]["modle_id"] = "typo"
    model["deployments"] = [{"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}, "max_ongoing_requests": 8}]
    _app(data, "server")["deployments"] = [{"name": "GatewayServer", "num_replicas": 2}]
    problems = check_config(_write(tmp_path, data))
    where = {problem.split(": ", 1)[0] for problem in problems}
    assert where == {
        "ray_namespace",
        "persistence.mode",
        "telemetry.enabled",
        "task_queue.tps_limit",
        "applications[1].args.device_group.ranks",
        "applications[1].args.device_mesh.fsdp_size",
        "applications[1].args.adapter_config",
        "applications[1].args.modle_id",
        "applications[1].deployments[0].autoscaling_config",
        "applications[1].deployments[0].max_ongoing_requests",
        "applications[0].deployments",
    }, problems
    assert "applications[1].args.modle_id: unknown key (did you mean 'model_id'?)" in problems
    assert any("for several copies of the model" in p and "num_replicas" in p for p in problems)
    assert any("session_timeout_s" in p for p in problems)  # the native key that comes closest
    with pytest.raises(ConfigurationError, match=r"has 11 problem\(s\)"):
        load_config(_write(tmp_path, data))


def test_names_of_the_one_base_model_must_agree(tmp_path):
    data = _layout()
    _app(data, "server")["args"]["supported_models"] = ["Qwen/Qwen3.5-4B"]
    _app(data, "sampler")["args"]["model_id"] = "builtin://other"
    _app(data, "sampler")["args"]["device_group"]["device_type"] = "cuda"
    problems = check_config(_write(tmp_path, data))
    assert _has(problems, "applications[0].args.supported_models[0]: 'Qwen/Qwen3.5-4B': the server hosts")
    assert _has(problems, "applications[2].args.model_id: 'builtin://other': the server samples the model")
    assert any("disagrees with" in p and "device_group" in p for p in problems)  # the sampler shares the model's device


def test_a_layout_key_and_a_native_key_must_agree(tmp_path):
    data = _layout()
    data["port"] = 9000
    assert check_config(_write(tmp_path, data)) == ["http_options.port: 8123 disagrees with port (9000); set it once"]
    data["port"] = 8123
    assert check_config(_write(tmp_path, data)) == []


def test_applications_must_be_the_servers_own_kinds_one_each(tmp_path):
    data = _layout()
    data["applications"].append({"name": "custom", "import_path": "my_package.app:build"})
    data["applications"].append(dict(_app(data, "model")))
    problems = check_config(_write(tmp_path, data))
    assert _has(problems, "applications[4].import_path: 'my_package.app:build': one of server, model")
    assert _has(problems, "applications[5]: a second model application (the first is applications[1])")
    data = {"applications": [_app(_layout(), "server")]}
    assert "applications: no model application (import_path: model) to name the base model" in check_config(
        _write(tmp_path, data)
    )


def test_the_native_device_key(tmp_path):
    assert load_config(_write(tmp_path, {"device": "cuda:1"})).device == "cuda:1"
    assert load_config(_write(tmp_path, {})).device is None
    assert check_config(_write(tmp_path, {"device": "tpu"})) == [
        "device: 'tpu' is not a device such as 'cpu', 'cuda' or 'cuda:1'"
    ]
