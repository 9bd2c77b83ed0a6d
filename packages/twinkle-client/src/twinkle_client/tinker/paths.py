"""Native ``twinkle://`` checkpoint paths as the ``tinker://`` paths the Tinker SDK understands.

The server stores a Tinker training state under its plain name and sampler
weights under ``sampler_weights/<name>`` (``twinkle.server.tinker.paths``), so:

- ``twinkle://<run>/<name>`` is ``tinker://<run>/weights/<name>``
- ``twinkle://<run>/sampler_weights/<name>`` is ``tinker://<run>/sampler_weights/<name>``

This module needs neither ``tinker`` nor the server.
"""

from __future__ import annotations

from twinkle.errors import InvalidInputError

TINKER_SCHEME = "tinker://"
TWINKLE_SCHEME = "twinkle://"
TRAINING_DIR = "weights"
SAMPLER_DIR = "sampler_weights"


def to_tinker_path(path: str) -> str:
    """``path`` as a ``tinker://`` path when it is a ``twinkle://`` one; any other path unchanged.

    Raises :class:`~twinkle.errors.InvalidInputError` (a ``ValueError``) for a
    ``twinkle://`` path that names no checkpoint, so the mistake is reported in
    Twinkle's terms rather than as "must start with 'tinker://'".
    """
    if not isinstance(path, str) or not path.startswith(TWINKLE_SCHEME):
        return path
    run_id, _, name = path.removeprefix(TWINKLE_SCHEME).partition("/")
    folder, _, sampler_name = name.partition("/")
    if run_id and folder == SAMPLER_DIR and sampler_name and "/" not in sampler_name:
        return f"{TINKER_SCHEME}{run_id}/{SAMPLER_DIR}/{sampler_name}"
    if run_id and name and "/" not in name and name != SAMPLER_DIR:
        return f"{TINKER_SCHEME}{run_id}/{TRAINING_DIR}/{name}"
    raise InvalidInputError(
        f"invalid checkpoint path {path!r}: expected '{TWINKLE_SCHEME}<run_id>/<name>' (a training state) "
        f"or '{TWINKLE_SCHEME}<run_id>/{SAMPLER_DIR}/<name>' (sampler weights)"
    )
