"""API keys: generation, hashing, request authentication and start-up sync from the config.

Keys are stored only as SHA-256 hex digests. A slow password hash (bcrypt,
scrypt) exists to make guessing low-entropy *passwords* expensive; our keys are
32 random bytes (``generate_api_key``) or at least ``MIN_API_KEY_LENGTH``
characters (config), so a preimage search is infeasible with any hash, and a
fast one keeps per-request checks at microseconds. Because the lookup is an
exact match on the digest of the presented key, response timing can at most
reveal digest prefixes, which say nothing about any key: no secret is ever
compared byte by byte.
"""

from __future__ import annotations

import hashlib
import secrets

from twinkle.errors import AuthenticationError
from twinkle.server.config import ServerConfig
from twinkle.server.store.base import Store

KEY_PREFIX = "tml-"
_DISPLAY_CHARS = 8
_HEADER_HELP = "send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"


def generate_api_key() -> str:
    """``tml-`` + 43 URL-safe characters (32 random bytes)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def display_prefix(key: str) -> str:
    """The start of a key, enough to tell keys apart in listings and messages, useless for guessing."""
    return key[:_DISPLAY_CHARS]


def issue_api_key(store: Store, user: str) -> str:
    """Create a new key for an existing ``user``, store its hash, return the key (the only time it exists)."""
    key = generate_api_key()
    store.add_api_key(user, hash_api_key(key), display_prefix(key), source="cli")
    return key


def authenticate(store: Store, header_value: str | None) -> str:
    """The user owning the key in an ``Authorization: Bearer <key>`` or ``X-API-Key: <key>`` header value."""
    parts = (header_value or "").split()
    if not parts or parts == ["Bearer"]:
        raise AuthenticationError(f"missing API key: {_HEADER_HELP}")
    if len(parts) == 2 and parts[0].lower() == "bearer":
        key = parts[1]
    elif len(parts) == 1:
        key = parts[0]
    elif len(parts) == 2:
        raise AuthenticationError(f"unsupported authorization scheme {parts[0]!r}: {_HEADER_HELP}")
    else:
        raise AuthenticationError(f"malformed credentials ({len(parts)} space-separated parts): {_HEADER_HELP}")
    user = store.user_for_key_hash(hash_api_key(key))
    if user is None:
        raise AuthenticationError(f"invalid API key {display_prefix(key)}...")
    return user


def sync_config_users(store: Store, config: ServerConfig) -> list[str]:
    """Make the store's config-sourced keys match the config (``users`` and ``api_keys_file``).

    Run at start-up: configured users are created, and a key removed from the
    config stops working. Keys issued by ``twinkle server add-user`` are kept.
    Returns the configured user names.
    """
    keys = config.api_keys()
    store.sync_config_keys(
        {user: [(hash_api_key(key), display_prefix(key)) for key in user_keys] for user, user_keys in keys.items()}
    )
    return sorted(keys)
