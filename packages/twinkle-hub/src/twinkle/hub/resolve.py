"""Turn a model or dataset reference into a local path that loaders can open.

Every component takes the same reference forms, so a cookbook moves from the
offline built-in to a real checkpoint by changing one string:

- ``builtin://name``: generated offline into the Twinkle cache on first use;
- ``hf://org/name`` or a bare ``org/name``: a Hugging Face Hub snapshot;
- ``ms://org/name``: a ModelScope snapshot (``pip install 'twinkle-hub[modelscope]'``);
- a local path: returned as given (``~`` expanded) once it is known to exist.
"""

from __future__ import annotations

import os
import re

from twinkle.errors import InvalidInputError, ResourceNotFoundError
from twinkle.hub.cache import materialize
from twinkle.hub.registry import BUILTIN_SCHEME, DEFAULT_MODEL, Kind, get_builtin, list_builtin
from twinkle.hub.remote import download_from_hf, download_from_modelscope

HF_SCHEME = "hf://"
MS_SCHEME = "ms://"

# ``org/name`` as the hubs spell repository ids; anything else that is not a local path is an error.
_BARE_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model_id: str | None = None) -> str:
    """Return a local Hugging Face model directory for ``model_id``.

    ``None`` or ``''`` means the offline default ``builtin://qwen3-tiny``.
    Raises :class:`ResourceNotFoundError` when the model cannot be found or downloaded.
    """
    return _resolve(model_id or DEFAULT_MODEL, "model")


def resolve_dataset(dataset_id: str) -> str:
    """Return a local dataset file or directory for ``dataset_id``.

    Built-in datasets resolve to a directory holding ``train.jsonl`` (and ``test.jsonl``
    where the dataset has a held-out split). Raises :class:`ResourceNotFoundError`
    when the dataset cannot be found or downloaded.
    """
    if not dataset_id:
        raise InvalidInputError(
            f"A dataset id is required, e.g. one of {', '.join(list_builtin('dataset'))} or a local path"
        )
    return _resolve(dataset_id, "dataset")


def _resolve(ref: str, kind: Kind) -> str:
    if not isinstance(ref, str):
        raise InvalidInputError(f"A {kind} id must be a string, got {type(ref).__name__}: {ref!r}")
    if ref.startswith(BUILTIN_SCHEME):
        spec = get_builtin(ref, kind)
        return str(materialize(spec.cache_name, spec.build))
    if ref.startswith(HF_SCHEME):
        return download_from_hf(_repo_id(ref, HF_SCHEME), kind, ref)
    if ref.startswith(MS_SCHEME):
        return download_from_modelscope(_repo_id(ref, MS_SCHEME), kind, ref)
    if "://" in ref:
        raise ResourceNotFoundError(
            f"Unsupported {kind} id {ref!r}: use a local path, '{HF_SCHEME}org/name', '{MS_SCHEME}org/name' "
            f"or one of {', '.join(list_builtin(kind))}"
        )
    return _resolve_local_or_bare_hub_id(ref, kind)


def _resolve_local_or_bare_hub_id(ref: str, kind: Kind) -> str:
    path = os.path.expanduser(ref)
    if os.path.exists(path):
        if kind == "model" and not os.path.isdir(path):
            raise ResourceNotFoundError(
                f"Model path {ref!r} is a file; pass the Hugging Face model directory that contains config.json"
            )
        return path
    if _BARE_HUB_ID.fullmatch(ref):
        try:
            return download_from_hf(ref, kind, ref)
        except ResourceNotFoundError as exc:
            raise ResourceNotFoundError(
                f"{ref!r} is not an existing local path, so it was read as '{HF_SCHEME}{ref}'. {exc}"
            ) from exc.__cause__
    raise ResourceNotFoundError(
        f"{kind.capitalize()} {ref!r} is not an existing local path. Pass a local path, "
        f"'{HF_SCHEME}org/name', '{MS_SCHEME}org/name' or one of {', '.join(list_builtin(kind))}"
    )


def _repo_id(ref: str, scheme: str) -> str:
    repo_id = ref.removeprefix(scheme).strip("/")
    if not repo_id:
        raise InvalidInputError(f"{ref!r} names no repository; expected '{scheme}org/name'")
    return repo_id
