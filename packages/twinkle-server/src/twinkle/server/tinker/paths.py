"""``tinker://`` paths and how they name the server's runs and checkpoints.

A Tinker path is ``tinker://<run_id>/weights/<name>`` (a training state: adapter
and optimizer) or ``tinker://<run_id>/sampler_weights/<name>`` (adapter only).
Both are ordinary checkpoints of the run in the store, so the native client sees
the same files: a training state is stored under its plain ``<name>`` (what the
native ``save(name)`` writes too) and sampler weights under
``sampler_weights/<name>``. The native ``twinkle://<run_id>/<name>`` form is
accepted wherever a Tinker path is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from twinkle.errors import InvalidInputError
from twinkle.server.paths import SAMPLER_WEIGHTS_DIR as SAMPLER_DIR

TINKER_SCHEME = "tinker://"
NATIVE_SCHEME = "twinkle://"
TRAINING_DIR = "weights"

CheckpointKind = Literal["training", "sampler"]


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: CheckpointKind
    name: str

    @property
    def store_name(self) -> str:
        """The checkpoint's name in the store (and its folder under the run's checkpoint directory)."""
        return self.name if self.kind == "training" else f"{SAMPLER_DIR}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """Tinker's ``checkpoint_id``: ``weights/<name>`` or ``sampler_weights/<name>``."""
        return f"{TRAINING_DIR if self.kind == 'training' else SAMPLER_DIR}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"{TINKER_SCHEME}{self.run_id}/{self.checkpoint_id}"

    @classmethod
    def from_store_name(cls, run_id: str, store_name: str) -> CheckpointPath:
        prefix = f"{SAMPLER_DIR}/"
        if store_name.startswith(prefix):
            return cls(run_id, "sampler", store_name.removeprefix(prefix))
        return cls(run_id, "training", store_name)


def parse_checkpoint_id(run_id: str, checkpoint_id: str) -> CheckpointPath:
    """``weights/<name>`` or ``sampler_weights/<name>`` of ``run_id``."""
    folder, _, name = checkpoint_id.partition("/")
    if folder not in (TRAINING_DIR, SAMPLER_DIR) or not name or "/" in name:
        raise InvalidInputError(
            f"invalid checkpoint id {checkpoint_id!r}: expected '{TRAINING_DIR}/<name>' or '{SAMPLER_DIR}/<name>'"
        )
    return CheckpointPath(run_id, "training" if folder == TRAINING_DIR else "sampler", name)


def parse_path(path: object) -> CheckpointPath:
    """A ``tinker://<run>/<weights|sampler_weights>/<name>`` or ``twinkle://<run>/<name>`` path."""
    if not isinstance(path, str):
        raise InvalidInputError(f"a checkpoint path must be a string, got {type(path).__name__}")
    if path.startswith(NATIVE_SCHEME):
        run_id, _, name = path.removeprefix(NATIVE_SCHEME).partition("/")
        if run_id and name:
            return CheckpointPath.from_store_name(run_id, name)
    elif path.startswith(TINKER_SCHEME):
        run_id, _, checkpoint_id = path.removeprefix(TINKER_SCHEME).partition("/")
        if run_id:
            return parse_checkpoint_id(run_id, checkpoint_id)
    raise InvalidInputError(
        f"invalid checkpoint path {path!r}: expected '{TINKER_SCHEME}<run_id>/{TRAINING_DIR}/<name>', "
        f"'{TINKER_SCHEME}<run_id>/{SAMPLER_DIR}/<name>' or '{NATIVE_SCHEME}<run_id>/<name>'"
    )


def training_run_id(session_id: str, model_seq_id: int) -> str:
    """The id of a session's ``model_seq_id``-th model: the SDK computes it itself for models created by loading."""
    return f"{session_id}:train:{model_seq_id}"


def sampler_id(session_id: str, sampling_session_seq_id: int) -> str:
    return f"{session_id}:sample:{sampling_session_seq_id}"
