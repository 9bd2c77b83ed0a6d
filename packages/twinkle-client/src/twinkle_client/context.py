"""The process-wide client every proxy (model, sampler, dataset, ...) talks through."""

from __future__ import annotations

import os
from typing import Any

from twinkle.errors import ConfigurationError
from twinkle_client.http import DEFAULT_BASE_URL, TwinkleClient

CHECKPOINT_SCHEME = "twinkle://"  # paths of checkpoints in a server's store
_client: TwinkleClient | None = None


def init_twinkle_client(base_url: str | None = None, api_key: str | None = None, **options: Any) -> TwinkleClient:
    """Connect to a Twinkle server and make it the one the proxies use; returns the client.

    ``base_url`` defaults to ``$TWINKLE_BASE_URL`` (else ``http://127.0.0.1:8000``), ``api_key`` to
    ``$TWINKLE_API_KEY``. ``options`` go to :class:`TwinkleClient` (``timeout``, ``heartbeat_interval``, ...).
    The session opens here, so a wrong address or key fails now rather than at the first training call.
    Calling it again replaces (and closes) the previous client.
    """
    global _client
    client = TwinkleClient(
        base_url or os.environ.get("TWINKLE_BASE_URL") or DEFAULT_BASE_URL,
        api_key if api_key is not None else os.environ.get("TWINKLE_API_KEY"),
        **options,
    )
    try:
        client.open_session()
    except BaseException:
        client.close()
        raise
    previous, _client = _client, client
    if previous is not None:
        previous.close()
    return client


def get_client() -> TwinkleClient:
    """The client set by :func:`init_twinkle_client`."""
    if _client is None:
        raise ConfigurationError(
            "no Twinkle server connection: call twinkle_client.init_twinkle_client(base_url, api_key) first"
        )
    return _client


def check_base_model(client: TwinkleClient, model_id: str | None, who: str) -> str:
    """The model ``who`` works on: the server's base model, or a full-model checkpoint in its store.

    ``model_id``, when given, must name one of the two: a server serves one base model, and a checkpoint
    (a ``twinkle://`` path returned by ``save``) is resolved by the server.
    """
    base_model = client.server_info()["base_model"]
    if model_id is not None and model_id.startswith(CHECKPOINT_SCHEME):
        return model_id
    if model_id is not None and model_id != base_model:
        raise ConfigurationError(
            f"{who}(model_id={model_id!r}): the server at {client.base_url} serves {base_model!r}; "
            f"pass model_id={base_model!r} (or omit it), a {CHECKPOINT_SCHEME} checkpoint it saved, "
            f"or connect to a server for {model_id!r}"
        )
    return base_model
