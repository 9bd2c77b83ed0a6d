"""Snapshot downloads from the Hugging Face Hub and ModelScope.

Both hubs raise many unrelated exception types (network, auth, validation). They
are translated into one :class:`ResourceNotFoundError` that names the id and tells
an offline user the way out: pass a local directory instead. The original error is
kept as ``__cause__``.
"""

from __future__ import annotations

from twinkle.errors import ResourceNotFoundError
from twinkle.hub.registry import Kind
from twinkle.utils import get_logger, require

logger = get_logger(__name__)


def download_from_hf(repo_id: str, kind: Kind, ref: str) -> str:
    """Download (or reuse the local HF cache of) ``repo_id`` and return its snapshot directory."""
    from huggingface_hub import snapshot_download

    logger.info("Fetching %s %r from the Hugging Face Hub", kind, ref)
    try:
        return snapshot_download(repo_id=repo_id, repo_type=kind)
    except (OSError, ValueError) as exc:  # HTTP, offline and cache misses are OSErrors; bad ids are ValueErrors
        raise ResourceNotFoundError(_unavailable_message(ref, kind, "the Hugging Face Hub", exc)) from exc


def download_from_modelscope(repo_id: str, kind: Kind, ref: str) -> str:
    """Download ``repo_id`` from ModelScope (needs ``twinkle-hub[modelscope]``) and return its directory."""
    modelscope = require("modelscope", "twinkle-hub[modelscope]", f"Downloading {ref!r} from ModelScope")
    download = modelscope.snapshot_download if kind == "model" else modelscope.dataset_snapshot_download
    logger.info("Fetching %s %r from ModelScope", kind, ref)
    try:
        directory: str = download(repo_id)
    except Exception as exc:  # modelscope's errors share no base class narrower than Exception
        raise ResourceNotFoundError(_unavailable_message(ref, kind, "ModelScope", exc)) from exc
    return directory


def _unavailable_message(ref: str, kind: Kind, hub: str, exc: BaseException) -> str:
    local = "directory" if kind == "model" else "file or directory"
    name = ref.rstrip("/").rsplit("/", 1)[-1]
    return (
        f"Could not get {kind} {ref!r} from {hub} ({type(exc).__name__}: {exc}). "
        f"If this machine is offline, download the {kind} elsewhere and pass its local {local} instead, "
        f"e.g. resolve_{kind}('/path/to/{name}')."
    )
