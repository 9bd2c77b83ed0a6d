import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle.server import cli
from twinkle.server.auth import authenticate
from twinkle.server.store import SQLiteStore

KEY = re.compile(r"^(tml-[A-Za-z0-9_-]{40,})$", re.MULTILINE)


def test_add_user_prints_a_key_once_that_authenticates(tmp_path, capsys):
    assert cli.main(["add-user", "alice", "--state-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    key = KEY.fullmatch(out.strip()).group(1)  # stdout is just the key, for scripts
    assert "User 'alice' created" in err and "it cannot be shown again" in err
    assert cli.main(["add-user", "alice", "--state-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    second = out.strip()
    assert "already existed; issued an additional API key" in err and second != key
    with SQLiteStore(tmp_path / "twinkle.db") as store:
        assert authenticate(store, f"Bearer {key}") == "alice"
        assert authenticate(store, second) == "alice"


def test_add_user_uses_the_configs_database(tmp_path, capsys):
    config = tmp_path / "server.yaml"
    config.write_text("database: db/users.db\n")
    assert cli.main(["add-user", "bob", "--config", str(config)]) == 0
    key = capsys.readouterr().out.strip()
    with SQLiteStore(tmp_path / "db" / "users.db") as store:
        assert authenticate(store, key) == "bob"


def test_add_user_refuses_bad_names(tmp_path, capsys):
    assert cli.main(["add-user", "../root", "--state-dir", str(tmp_path)]) == 1
    assert "invalid user name '../root'" in capsys.readouterr().err


def test_check_config_exit_codes(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("port: 9000\n")
    bad.write_text("prot: 9000\nmax_loras: 0\n")
    assert cli.main(["check-config", str(good)]) == 0
    assert capsys.readouterr().out == "OK\n"
    assert cli.main(["check-config", str(bad)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{bad}: prot: unknown key (did you mean 'port'?)",
        f"{bad}: max_loras: must be positive, got 0",
    ]


def test_serve_passes_the_merged_config_to_the_app(tmp_path, monkeypatch):
    import types

    seen = []
    fake_app = types.ModuleType("twinkle.server.application")
    fake_app.run_server = seen.append
    monkeypatch.setitem(sys.modules, "twinkle.server.application", fake_app)
    config = tmp_path / "server.yaml"
    config.write_text("port: 9000\nmax_loras: 2\n")
    assert cli.main(["--config", str(config), "--port", "9100", "--state-dir", str(tmp_path / "s")]) == 0
    (served,) = seen
    assert (served.port, served.max_loras, served.host) == (9100, 2, "127.0.0.1")
    assert served.database == tmp_path / "s" / "twinkle.db"


def test_serve_reports_config_problems(tmp_path, capsys):
    assert cli.main(["--port", "70000", "--state-dir", str(tmp_path)]) == 1
    assert "port: must be in 0..65535" in capsys.readouterr().err


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "twinkle server add-user NAME" in out and "twinkle server check-config FILE" in out


def test_twinkle_console_script_add_user(tmp_path):
    twinkle = Path(sys.executable).with_name("twinkle")
    result = subprocess.run(
        [str(twinkle), "server", "add-user", "carol", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert "cannot be shown again" in result.stderr
    with SQLiteStore(tmp_path / "twinkle.db") as store:
        assert authenticate(store, result.stdout.strip()) == "carol"
