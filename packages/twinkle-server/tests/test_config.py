from pathlib import Path

import pytest

from twinkle.errors import ConfigurationError
from twinkle.server.config import Quotas, ServerConfig, UserConfig, check_config, load_config

GOOD = """
model_id: builtin://qwen3-tiny
port: 9001
state_dir: state
max_rank: 32
session_timeout_s: 30
checkpoint_sweep_interval_s: 5
api_keys_file: keys.json
quotas: {max_adapters: 2, max_rank: 16, requests_per_second: 5}
users:
  alice:
    api_keys: [alice-key-0123456789abcdef]
    quotas: {max_adapters: 8}
  bob:
"""


def _write(tmp_path: Path, text: str, name: str = "server.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config()
    assert (config.model_id, config.host, config.port) == ("builtin://qwen3-tiny", "127.0.0.1", 8000)
    assert config.state_dir == tmp_path / ".twinkle" / "server"
    assert config.database == config.state_dir / "twinkle.db"
    assert config.checkpoint_dir == config.state_dir / "checkpoints"
    assert (config.max_loras, config.max_rank, config.session_timeout_s) == (8, 64, 120.0)
    assert config.max_tokens_per_pass == 32768 and config.checkpoint_sweep_interval_s == 60.0
    assert config.cycle_wait_s == 0.05
    assert config.quotas == Quotas(max_adapters=4, max_rank=64, max_tokens_per_request=65536, requests_per_second=50.0)
    assert config.users == {} and config.api_keys() == {}


def test_load_file_relative_paths_and_overrides(tmp_path, monkeypatch):
    _write(tmp_path, '{"carol": ["carol-key-0123456789abcdef"]}', "keys.json")
    path = _write(tmp_path, GOOD)
    monkeypatch.chdir("/")
    config = load_config(path)
    assert config.port == 9001 and config.max_rank == 32 and config.session_timeout_s == 30.0
    assert config.checkpoint_sweep_interval_s == 5.0 and isinstance(config.checkpoint_sweep_interval_s, float)
    assert config.state_dir == tmp_path / "state"  # relative to the config file, not the cwd
    assert config.database == tmp_path / "state" / "twinkle.db"
    assert isinstance(config.quotas.requests_per_second, float)
    assert config.quotas_for("alice") == Quotas(8, 16, 65536, 5.0)
    assert config.quotas_for("bob") == config.quotas_for("nobody") == Quotas(2, 16, 65536, 5.0)
    assert config.api_keys() == {
        "alice": ["alice-key-0123456789abcdef"],
        "bob": [],
        "carol": ["carol-key-0123456789abcdef"],
    }
    monkeypatch.chdir(tmp_path)
    flagged = load_config(path, port=7000, host=None, state_dir="elsewhere")
    assert flagged.port == 7000 and flagged.host == "127.0.0.1"
    assert flagged.state_dir == tmp_path / "elsewhere"  # flags are relative to the cwd
    assert flagged.checkpoint_dir == tmp_path / "elsewhere" / "checkpoints"


def test_default_rank_quota_is_capped_at_the_servers_max_rank(tmp_path):
    path = _write(tmp_path, "max_rank: 16\nusers: {alice: {quotas: {max_rank: 8}}}\n")
    assert check_config(path) == []
    config = load_config(path)
    assert config.quotas_for("bob").max_rank == 16 and config.quotas_for("alice").max_rank == 8


def test_api_keys_are_checked_when_read(tmp_path):
    (tmp_path / "keys.yaml").write_text("bob: [short]\n")
    config = ServerConfig(users={"alice": UserConfig(api_keys=["k" * 20])}, api_keys_file=tmp_path / "keys.yaml")
    with pytest.raises(ConfigurationError, match=r"api keys of user 'bob'\[0\]: API keys need at least 16 characters"):
        config.api_keys()
    (tmp_path / "keys.yaml").write_text(f"bob: [{'k' * 20}]\n")
    with pytest.raises(ConfigurationError, match=r"key kkkkkkkk\.\.\. is already listed for user 'alice'"):
        config.api_keys()


def test_max_tokens_per_pass_zero_means_never_batch(tmp_path):
    path = _write(tmp_path, "max_tokens_per_pass: 0\n")
    assert check_config(path) == []
    assert load_config(path).max_tokens_per_pass == 0
    assert load_config(_write(tmp_path, "max_tokens_per_pass: 4096\n")).max_tokens_per_pass == 4096


def test_cycle_wait_accepts_zero_and_whole_seconds(tmp_path):
    assert load_config(_write(tmp_path, "cycle_wait_s: 0\n")).cycle_wait_s == 0
    assert load_config(_write(tmp_path, "cycle_wait_s: 1\n")).cycle_wait_s == 1.0


def test_direct_construction_derives_paths(tmp_path):
    config = ServerConfig(state_dir=tmp_path, database=tmp_path / "x.db")
    assert config.database == tmp_path / "x.db" and config.checkpoint_dir == tmp_path / "checkpoints"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("max_lora: 4", "max_lora: unknown key (did you mean 'max_loras'?)"),
        ("colour: red", "colour: unknown key; known keys: model_id, host, port"),
        ("port: '8000'", "port: expected int, got str ('8000')"),
        ("port: true", "port: expected int, got bool (True)"),
        ("port: 70000", "port: must be in 0..65535"),
        ("max_loras: 0", "max_loras: must be positive, got 0"),
        ("session_timeout_s: -1", "session_timeout_s: must be positive, got -1"),
        ("checkpoint_sweep_interval_s: 0", "checkpoint_sweep_interval_s: must be positive, got 0"),
        ("max_tokens_per_pass: -1", "max_tokens_per_pass: must be >= 0 (0 never batches tenants together), got -1"),
        ("max_tokens_per_pass: 1.5", "max_tokens_per_pass: expected int, got float (1.5)"),
        ("cycle_wait_s: -0.5", "cycle_wait_s: must be >= 0 (0 never waits for a pass to fill), got -0.5"),
        ("cycle_wait_s: soon", "cycle_wait_s: expected float, got str ('soon')"),
        ("host: ''", "host: must not be empty"),
        ("quotas: {max_rnk: 8}", "quotas.max_rnk: unknown key (did you mean 'quotas.max_rank'?)"),
        ("quotas: {max_adapters: 1.5}", "quotas.max_adapters: expected int, got float (1.5)"),
        ("quotas: {requests_per_second: 0}", "quotas.requests_per_second: must be positive, got 0"),
        ("quotas: {max_rank: 128}", "quotas.max_rank: 128 exceeds the server's max_rank 64"),
        (
            "users: {alice: {quotas: {max_rank: 99}}}",
            "users.alice.quotas.max_rank: 99 exceeds the server's max_rank 64",
        ),
        ("users: {alice: {api_key: [x]}}", "users.alice.api_key: unknown key (did you mean 'users.alice.api_keys'?)"),
        ("users: {alice: {api_keys: short}}", "users.alice.api_keys: expected list, got str ('short')"),
        ("users: {alice: {api_keys: [short]}}", "users.alice.api_keys[0]: API keys need at least 16 characters"),
        ("users: {alice: {api_keys: [7]}}", "users.alice.api_keys[0]: expected a string key, got int"),
        ("users: {'../evil': {}}", "users.../evil: invalid user name '../evil'"),
        ("users: {alice: [k]}", "users.alice: expected a mapping with api_keys and/or quotas, got list"),
        (
            "users: {a: {api_keys: [same-key-0123456789]}, b: {api_keys: [same-key-0123456789]}}",
            "users.b.api_keys[0]: key same-key... is already listed for user 'a'",
        ),
        ("api_keys_file: missing.yaml", "missing.yaml: file does not exist"),
        ("api_keys_file: 3", "api_keys_file: expected str, got int"),
        ("[1, 2]", "must hold a mapping of option: value, got list"),
        ("port: [1", "is not valid YAML"),
    ],
)
def test_check_config_names_each_problem(tmp_path, text, problem):
    path = _write(tmp_path, text)
    problems = check_config(path)
    assert len(problems) == 1, problems
    assert problem in problems[0]
    with pytest.raises(ConfigurationError, match=r"has 1 problem\(s\)|must hold a mapping|not valid YAML"):
        load_config(path)


def test_check_config_lists_every_problem_at_once(tmp_path):
    _write(tmp_path, "alice: [tiny]\nbob: not-a-list\n", "keys.yaml")
    path = _write(
        tmp_path, "max_loras: 0\nport: 99999\napi_keys_file: keys.yaml\nusers: {alice: {quotas: {max_rank: 0}}}\n"
    )
    problems = check_config(path)
    assert [p.split(":")[0] for p in problems] == [
        "port",
        "max_loras",
        "users.alice.quotas.max_rank",
        f"api_keys_file {tmp_path / 'keys.yaml'}",
        f"api_keys_file {tmp_path / 'keys.yaml'}",
    ]
    assert "bob: expected a list of keys, got str" in problems[3]
    assert "alice[0]: API keys need at least 16 characters" in problems[4]


def test_good_config_and_missing_file(tmp_path):
    _write(tmp_path, '{"carol": ["carol-key-0123456789abcdef"]}', "keys.json")
    assert check_config(_write(tmp_path, GOOD)) == []
    assert check_config(tmp_path / "nope.yaml") == [f"config file {tmp_path / 'nope.yaml'} does not exist"]


def test_unknown_override_is_refused():
    with pytest.raises(ConfigurationError, match=r"unknown server option\(s\) \['prot'\]"):
        load_config(prot=1)


def test_model_options_reach_the_models_the_server_builds(tmp_path):
    from twinkle.kernel import get_kernel_report
    from twinkle.server.services.pool import ModelPool

    config = load_config(_write(tmp_path, "gradient_checkpointing: true\nkernels: true\n"))
    assert config.model_options == {
        "backend": "transformers",
        "gradient_checkpointing": True,
        "kernels": True,
        "record_routing": False,
        "sampler": "torch",
        "sampler_args": {},
    }
    pool = ModelPool(config.model_id, 2, 8, "cpu", config.model_options)
    assert pool.model.model.is_activation_checkpointing
    report = get_kernel_report(pool.model.model)
    assert report is not None and {entry.target for entry in report.entries} >= {"Qwen3RMSNorm", "output_logps"}
    with pytest.raises(ConfigurationError, match="kernels"):
        load_config(_write(tmp_path, "kernels: triton\n", "bad.yaml"))


def test_backend_megatron_is_checked_with_the_options_it_cannot_take_yet(tmp_path):
    assert check_config(_write(tmp_path, "backend: megatron\ngradient_checkpointing: true\n")) == []
    problems = check_config(_write(tmp_path, "backend: megatron\nkernels: true\nrecord_routing: true\n", "b.yaml"))
    assert problems == [
        "kernels: not available with backend: megatron yet (use backend: transformers)",
        "record_routing: not available with backend: megatron yet (use backend: transformers)",
    ]
    assert check_config(_write(tmp_path, "backend: jax\n", "c.yaml")) == [
        "backend: 'jax' is not a training back-end; one of transformers, megatron"
    ]


def test_record_routing_reaches_the_samplers_and_needs_a_moe_model(tmp_path):
    from twinkle.server.services.pool import ModelPool

    config = load_config(_write(tmp_path, "model_id: builtin://qwen3-moe-tiny\nrecord_routing: true\n"))
    pool = ModelPool(config.model_id, 2, 8, "cpu", config.model_options)
    assert pool.routing == (4, 2, 8)  # MoE layers, experts per token, experts: what records are checked against
    feature = pool.sample(None, {"input_ids": [151644, 872]}, {"max_tokens": 1}, None).sequences[0].new_input_feature
    assert feature is not None and len(feature["routed_experts"]) == len(feature["input_ids"]) == 3
    assert "record_routing" not in pool.options  # the trainer replays what features carry; it records nothing
    with pytest.raises(ConfigurationError, match=r"record_routing: Qwen3ForCausalLM \(.*\) has no softmax top-k"):
        ModelPool("builtin://qwen3-tiny", 2, 8, "cpu", {"record_routing": True})
    assert check_config(_write(tmp_path, "record_routing: sometimes\n", "bad.yaml")) == [
        "record_routing: expected bool, got str ('sometimes')"
    ]
