"""``init_tinker_client``: prepare the installed ``tinker`` SDK (0.38) for a Twinkle server.

The server speaks the Tinker HTTP API, so the SDK mostly works unmodified. What
is left is done here, each piece for one reason:

- environment fallbacks, so ``tinker.ServiceClient()`` without arguments reaches
  the Twinkle server the native client would (the SDK reads ``TINKER_BASE_URL``
  and ``TINKER_API_KEY`` when a client is built);
- three patches of client-side checks that would refuse what the server accepts
  (see :func:`_patch_checkpoint_parsing`, :func:`_patch_sampling_session` and
  :func:`_patch_api_key_prefix`). Every patch forwards to the SDK's own code and
  changes nothing for ``tinker://`` paths and ``tml-``/``eyJ`` keys, so clients
  of the real Tinker service in the same process behave as before.

Not patched: loading a training client or state from a path
(``create_training_client_from_state*``, ``load_state*``) and the REST calls
that send a path as is; the SDK checks nothing there and the server resolves
``twinkle://`` paths itself. The ``tinker`` command line (a separate process)
keeps its own ``tinker://`` checks.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from types import ModuleType
from typing import Any

from twinkle.utils import get_logger, require
from twinkle_client.http import API_PREFIX, DEFAULT_BASE_URL
from twinkle_client.tinker.paths import to_tinker_path

logger = get_logger(__name__)

EXTRA = "twinkle-client[tinker]"
SDK_KEY_PREFIXES = ("tml-", "eyJ")  # what tinker 0.38's ApiKeyAuthProvider accepts
_PATCHED = "__twinkle_patched__"  # marks a patched function, so a patch is never stacked on itself
_lock = threading.Lock()
_patches_applied = False


def require_tinker() -> ModuleType:
    """The ``tinker`` module, or a ``MissingDependencyError`` (an ``ImportError``) naming the extra."""
    return require("tinker", EXTRA, "twinkle_client's Tinker SDK support")


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> None:
    """Make the ``tinker`` SDK talk to a Twinkle server; call it before creating Tinker clients.

    Sets ``$TINKER_BASE_URL`` to ``base_url``, else keeps an existing value, else
    takes the native client's ``$TWINKLE_BASE_URL``, else its default
    ``http://127.0.0.1:8000`` (a trailing ``/twinkle/v1`` is dropped: the Tinker API
    lives at ``/api/v1`` of the same server). ``$TINKER_API_KEY`` likewise: ``api_key``,
    an existing value, then ``$TWINKLE_API_KEY`` (left unset when none is given).
    Explicit arguments win so that ``init_tinker_client(url, key)`` means what it says.

    The SDK patches are applied once per process (later calls only update the
    environment); after them the SDK also accepts ``twinkle://`` checkpoint paths
    and Twinkle API keys configured without the ``tml-`` prefix. Keys made by
    ``twinkle server add-user`` already start with ``tml-`` and need no patch;
    keys listed in the server config may be any string of 16+ characters.

    Raises ``MissingDependencyError`` (an ``ImportError``) when ``tinker`` is not
    installed: ``pip install 'twinkle-client[tinker]'``.
    """
    tinker = require_tinker()
    url = _first(base_url, os.environ.get("TINKER_BASE_URL"), os.environ.get("TWINKLE_BASE_URL")) or DEFAULT_BASE_URL
    os.environ["TINKER_BASE_URL"] = _tinker_base_url(url)
    key = _first(api_key, os.environ.get("TINKER_API_KEY"), os.environ.get("TWINKLE_API_KEY"))
    if key:
        os.environ["TINKER_API_KEY"] = key
    global _patches_applied
    with _lock:
        if not _patches_applied:
            _patch_checkpoint_parsing(tinker)
            _patch_sampling_session()
            _patch_api_key_prefix()
            _patches_applied = True
            logger.debug("tinker %s prepared for a Twinkle server", tinker.__version__)


def _first(*values: str | None) -> str | None:
    """The first non-empty value (the SDK, too, treats an empty variable as unset)."""
    return next((value for value in values if value), None)


def _tinker_base_url(url: str) -> str:
    """The server root: the native client accepts ``<root>/twinkle/v1``, the SDK appends ``/api/v1`` itself."""
    return url.rstrip("/").removesuffix(API_PREFIX).rstrip("/")


def _attribute(owner: Any, name: str) -> Any:
    """``owner.name``, or an ImportError that names the supported SDK (the patches follow 0.38's internals)."""
    try:
        return getattr(owner, name)
    except AttributeError as exc:
        version = getattr(require_tinker(), "__version__", "?")
        raise ImportError(
            f"tinker {version} lacks {getattr(owner, '__name__', owner)}.{name}, which twinkle_client adapts; "
            f"install the supported SDK with: pip install '{EXTRA}'"
        ) from exc


def _mark(function: Any) -> Any:
    setattr(function, _PATCHED, True)
    return function


def _patch_checkpoint_parsing(tinker: ModuleType) -> None:
    """``ParsedCheckpointTinkerPath.from_tinker_path`` raises unless the path starts with ``tinker://``.

    The ``RestClient`` parses every ``*_from_tinker_path`` argument with it, and
    user code (e.g. the Tinker cookbook) calls it to find a path's run, so a
    ``twinkle://`` path is translated to its ``tinker://`` form first.
    """
    parsed_class = tinker.types.ParsedCheckpointTinkerPath
    original = _attribute(parsed_class, "from_tinker_path").__func__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def from_tinker_path(cls: type, tinker_path: str) -> Any:
        return original(cls, to_tinker_path(tinker_path))

    parsed_class.from_tinker_path = classmethod(_mark(from_tinker_path))


def _patch_sampling_session() -> None:
    """``InternalClientHolder._create_sampling_session`` raises unless ``model_path`` starts with ``tinker://``.

    Every ``create_sampling_client(model_path=...)`` (of a ``ServiceClient`` or a
    ``TrainingClient``) passes through it, so translating here covers them all,
    and the request then carries the ``tinker://`` path.
    """
    holder_class = importlib.import_module("tinker.lib.internal_client_holder").InternalClientHolder
    original = _attribute(holder_class, "_create_sampling_session")
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    async def _create_sampling_session(self: Any, model_path: str | None = None, base_model: str | None = None) -> str:
        path = None if model_path is None else to_tinker_path(model_path)
        return await original(self, model_path=path, base_model=base_model)

    holder_class._create_sampling_session = _mark(_create_sampling_session)


def _patch_api_key_prefix() -> None:
    """``ApiKeyAuthProvider`` refuses keys that start with neither ``tml-`` nor ``eyJ``.

    Generated Twinkle keys start with ``tml-``, but an operator may list any key
    of 16+ characters in the server config; the server, not the client, decides
    whether a key is valid. Other keys are set up exactly as an opaque ``tml-``
    key (no expiry), then hold the real key.
    """
    provider_class = importlib.import_module("tinker.lib._auth_token_provider").ApiKeyAuthProvider
    original = _attribute(provider_class, "__init__")
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, api_key: str) -> None:
        if not isinstance(api_key, str) or api_key.startswith(SDK_KEY_PREFIXES):
            original(self, api_key)
            return
        original(self, SDK_KEY_PREFIXES[0] + api_key)
        self._token = api_key  # what the ``api_key`` property and ``get_token`` return (0.38)

    provider_class.__init__ = _mark(__init__)
