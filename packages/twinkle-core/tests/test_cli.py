from twinkle import cli


class _FakeEntryPoint:
    def __init__(self, name, fn):
        self.name, self.value, self._fn = name, f"fake.module:{name}", fn

    def load(self):
        return self._fn


def test_dispatches_to_the_named_plugin(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(
        cli, "_commands", lambda: {"echo": _FakeEntryPoint("echo", lambda argv: seen.append(argv) or 3)}
    )
    assert cli.main(["echo", "--flag", "x"]) == 3
    assert seen == [["--flag", "x"]]
    assert cli.main(["--help"]) == 0
    assert "echo" in capsys.readouterr().out


def test_unknown_command_lists_commands(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_commands", dict)
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nope'" in err and "pip install twinkle-recipes" in err
    assert cli.main([]) == 2
