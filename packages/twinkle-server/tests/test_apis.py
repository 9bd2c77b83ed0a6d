"""API plugins (``twinkle.server.apis``): the Tinker API is one; ``apis:`` picks them; a missing dependency is named."""

from __future__ import annotations

import logging
import textwrap
from importlib.metadata import EntryPoint, entry_points

import pytest
from fastapi.testclient import TestClient

from twinkle.errors import ConfigurationError
from twinkle.server import apis
from twinkle.server.application import create_app
from twinkle.server.config import ServerConfig, check_config

# A third-party API: one route that reads the shared server state and its own, one that fails.
ECHO_API = """
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from twinkle.errors import InvalidInputError

router = APIRouter(prefix="/echo/v1")


@router.get("/state")
def state(request: Request):
    return {"max_loras": request.app.state.server.config.max_loras, **request.app.state.echo}


@router.get("/fail")
def fail():
    raise InvalidInputError("the echo API refuses this")


class EchoApi:
    name = "echo"

    def include_routers(self, app):
        app.include_router(router)

    def start(self, state):
        return {"started_with_users": sorted(state.config.users)}

    def owns(self, path):
        return path.startswith("/echo/")

    def error_reply(self, exc):
        return JSONResponse({"echo_error": str(exc)}, status_code=418)


API = EchoApi()
"""


@pytest.fixture
def published(monkeypatch, tmp_path):
    """The installed APIs plus ``echo`` (a module on sys.path) and ``broken`` (its module is not installed)."""
    (tmp_path / "echo_api.py").write_text(textwrap.dedent(ECHO_API))
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = [
        EntryPoint("echo", "echo_api:API", apis.ENTRY_POINT_GROUP),
        EntryPoint("broken", "not_installed_anywhere.api:API", apis.ENTRY_POINT_GROUP),
    ]
    real = list(entry_points(group=apis.ENTRY_POINT_GROUP))
    monkeypatch.setattr(apis, "entry_points", lambda group: [*real, *extra] if group == apis.ENTRY_POINT_GROUP else [])


def test_twinkle_server_publishes_the_tinker_and_openai_apis():
    assert {"tinker", "openai"} <= set(apis.installed_api_names())
    assert [api.name for api in apis.load_apis(["tinker", "openai"])] == ["tinker", "openai"]


def test_a_plugin_is_served_beside_the_native_api_and_answers_errors_its_own_way(published, tmp_path):
    config = ServerConfig(state_dir=tmp_path / "state", apis=["echo"], users={})
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        assert client.get("/echo/v1/state").json() == {"max_loras": config.max_loras, "started_with_users": []}
        failed = client.get("/echo/v1/fail")
        assert (failed.status_code, failed.json()) == (418, {"echo_error": "the echo API refuses this"})
        assert client.get("/healthz").status_code == 200  # the native API is always served
        assert client.get("/api/v1/healthz").status_code == 404  # the Tinker API was not asked for


def test_without_apis_every_installed_one_that_imports_is_served(published, caplog):
    with caplog.at_level(logging.WARNING, logger=apis.__name__):
        served = [api.name for api in apis.load_apis(None)]
    assert served == ["echo", "openai", "tinker"]
    assert "the broken API needs the module 'not_installed_anywhere'" in caplog.text


def test_an_api_asked_for_must_load_and_exist(published):
    with pytest.raises(ConfigurationError, match="the broken API needs the module 'not_installed_anywhere'"):
        apis.load_apis(["tinker", "broken"])
    with pytest.raises(
        ConfigurationError, match=r"no server API named \['tinkr'\]; installed: broken, echo, openai, tinker"
    ):
        apis.load_apis(["tinkr"])


def test_an_empty_list_serves_only_the_native_api(tmp_path):
    config = ServerConfig(state_dir=tmp_path / "state", apis=[])
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/api/v1/healthz").status_code == 404
        assert not hasattr(client.app.state, "tinker")


def test_the_config_names_unknown_apis(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("apis: [tinker, tinkr, 3]\n")
    assert check_config(path) == [
        "apis[1]: no server API named 'tinkr'; installed: openai, tinker",
        "apis[2]: expected the name of a server API, got int (3)",
    ]
    path.write_text("apis: tinker\n")
    assert check_config(path) == ["apis: expected list, got str ('tinker')"]
