import re

import pytest

from twinkle.errors import AuthenticationError, ConfigurationError
from twinkle.server.auth import (
    authenticate,
    generate_api_key,
    hash_api_key,
    issue_api_key,
    sync_config_users,
)
from twinkle.server.config import ServerConfig, UserConfig
from twinkle.server.store import SQLiteStore

CONFIG_KEY = "config-key-0123456789abcdef"


@pytest.fixture
def store(tmp_path):
    with SQLiteStore(tmp_path / "twinkle.db") as store:
        store.add_user("alice")
        yield store


def test_generated_keys_are_long_random_and_url_safe():
    keys = {generate_api_key() for _ in range(50)}
    assert len(keys) == 50
    for key in keys:
        assert re.fullmatch(r"tml-[A-Za-z0-9_-]{40,}", key)


@pytest.mark.parametrize("header", ["Bearer {key}", "bearer {key}", "{key}", "  Bearer   {key}  "])
def test_both_header_forms_authenticate(store, header):
    key = issue_api_key(store, "alice")
    assert authenticate(store, header.format(key=key)) == "alice"


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"),
        ("", "missing API key"),
        ("Bearer ", "missing API key"),
        ("Bearer tml-not-a-real-key-at-all", r"invalid API key tml-not-\.\.\."),
        ("Basic dXNlcjpwYXNz", "unsupported authorization scheme 'Basic'"),
        ("Bearer a b", r"malformed credentials \(3 space-separated parts\)"),
    ],
)
def test_missing_or_wrong_keys_are_refused(store, header, message):
    issue_api_key(store, "alice")
    with pytest.raises(AuthenticationError, match=message):
        authenticate(store, header)


def test_only_hashes_are_stored(tmp_path):
    path = tmp_path / "twinkle.db"
    with SQLiteStore(path) as store:
        store.add_user("alice")
        key = issue_api_key(store, "alice")
        assert store.user_for_key_hash(hash_api_key(key)) == "alice"
    stored = b"".join(p.read_bytes() for p in tmp_path.iterdir())  # the db and its WAL/SHM files
    assert hash_api_key(key).encode() in stored
    assert key.encode() not in stored
    assert key[4:].encode() not in stored  # not even the random part


def test_sync_config_users_adds_and_revokes_config_keys(store, tmp_path):
    key_file = tmp_path / "keys.json"
    key_file.write_text('{"carol": ["carol-key-0123456789abcdef"]}')
    config = ServerConfig(
        state_dir=tmp_path,
        users={"alice": UserConfig(api_keys=[CONFIG_KEY]), "dave": UserConfig()},
        api_keys_file=key_file,
    )
    cli_key = issue_api_key(store, "alice")
    assert sync_config_users(store, config) == ["alice", "carol", "dave"]
    assert authenticate(store, f"Bearer {CONFIG_KEY}") == "alice"
    assert authenticate(store, "carol-key-0123456789abcdef") == "carol"
    assert store.get_user("dave") is not None
    key_file.write_text("{}")  # carol's key removed from the file: revoked at the next start
    sync_config_users(store, config)
    with pytest.raises(AuthenticationError):
        authenticate(store, "carol-key-0123456789abcdef")
    assert authenticate(store, cli_key) == "alice"  # add-user keys are not the config's to revoke


def test_sync_config_users_reports_a_broken_key_file(store, tmp_path):
    config = ServerConfig(state_dir=tmp_path, api_keys_file=tmp_path / "gone.yaml")
    with pytest.raises(ConfigurationError, match=r"gone\.yaml: file does not exist"):
        sync_config_users(store, config)
