"""Tinker's saves and loads: checkpoints of a run in the server's store, shared with the native API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinkle.errors import InvalidInputError
from twinkle.server.paths import safe_child
from twinkle.server.services.checkpoints import CheckpointHold
from twinkle.server.services.pool import ModelPool
from twinkle.server.tinker.jobs import Caller
from twinkle.server.tinker.paths import CheckpointPath, parse_path
from twinkle.server.tinker.replies import json_result


def check_new_checkpoint(caller: Caller, target: CheckpointPath, overwrite: bool) -> None:
    """Refuse a name that cannot be a folder, or one already saved unless ``overwrite``."""
    safe_child(caller.state.config.checkpoint_dir, caller.user, target.run_id, target.name)
    if not overwrite and caller.state.checkpoints.get(caller.user, target.run_id, target.store_name):
        raise InvalidInputError(f"checkpoint {target.tinker_path!r} exists; pass overwrite=True to replace it")


def write(pool: ModelPool, run_id: str, directory: Path, with_optimizer: bool) -> str:
    """Write the run's adapter (with optimizer state for a training checkpoint) to ``directory``."""
    path = pool.model.save(
        directory.name, output_dir=str(directory.parent), save_optimizer=with_optimizer, adapter_name=run_id
    )
    return str(path)


def record(caller: Caller, target: CheckpointPath, path: str, ttl_seconds: float | None) -> bytes:
    """Record a written checkpoint (at ``path``, expiring ``ttl_seconds`` from now) and make the reply."""
    caller.state.checkpoints.record(caller.user, target.run_id, target.store_name, path, ttl_seconds)
    caller.tinker.forget_loaded(sampler_adapter_name(caller.user, target))  # a sampler must not serve the old files
    return json_result({"path": target.tinker_path})


def resolve(caller: Caller, path: object) -> CheckpointPath:
    """A live checkpoint path of the caller's (any of their runs); 404 for anything else."""
    target = parse_path(path)
    caller.state.checkpoints.existing(caller.user, target.run_id, target.store_name, shown=target.tinker_path)
    return target


def hold(caller: Caller, path: object) -> tuple[CheckpointPath, CheckpointHold]:
    """:func:`resolve`, its files kept until the hold is released (the task reading them is over)."""
    target = parse_path(path)
    held = caller.state.checkpoints.hold(caller.user, target.run_id, target.store_name, shown=target.tinker_path)
    return target, held


def load(pool: ModelPool, run_id: str, directory: Path, with_optimizer: bool) -> bytes:
    pool.model.load(str(directory), adapter_name=run_id, load_optimizer=with_optimizer)
    return json_result({"model_id": run_id, "type": "load_weights"})


def delete(caller: Caller, target: CheckpointPath) -> None:
    caller.state.checkpoints.delete(caller.user, target.run_id, target.store_name, shown=target.tinker_path)


def set_ttl(caller: Caller, target: CheckpointPath, ttl_seconds: float | None) -> None:
    caller.state.checkpoints.set_ttl(caller.user, target.run_id, target.store_name, ttl_seconds, target.tinker_path)


def sampler_adapter_name(user: str, target: CheckpointPath) -> str:
    """The sampler adapter serving a saved checkpoint (users' run ids never collide: they embed the session)."""
    return f"ckpt:{user}:{target.run_id}/{target.store_name}"


def source_lora_config(caller: Caller, target: CheckpointPath) -> dict[str, Any]:
    run = caller.state.store.get_run(caller.user, target.run_id)
    if run is None or run.lora_config is None:
        raise InvalidInputError(f"{target.tinker_path!r} is not a LoRA checkpoint: Tinker trains LoRA adapters only")
    return dict(run.lora_config)
