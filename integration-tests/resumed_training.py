"""The torchrun workers' shared run: steps with a checkpoint after the second, then the later ones again from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def steps(model: Any, batch: list[dict[str, Any]], count: int) -> tuple[list[float], list[float]]:
    """``count`` forward_backward + clip_grad_and_step calls on ``batch``: their losses and gradient norms."""
    losses, norms = [], []
    for _ in range(count):
        losses.append(model.forward_backward(inputs=batch).loss)
        norms.append(model.clip_grad_and_step(max_grad_norm=1.0)["grad_norm"])
    return losses, norms


def train_save_resume(
    make_model: Callable[[], Any], batch: list[dict[str, Any]], output_dir: Path, after: int = 2, resume: bool = True
) -> dict[str, Any]:
    """Losses and norms of 2 + ``after`` steps, the losses of the ``after`` steps resumed in a fresh model from the
    step-2 checkpoint (None without ``resume``), and the final weights' path."""
    model = make_model()
    losses, norms = steps(model, batch, 2)
    checkpoint = model.save("step-2", output_dir=output_dir) if resume else None
    more_losses, more_norms = steps(model, batch, after)
    final = model.save("final", output_dir=output_dir, save_optimizer=False)
    resumed_losses = None
    if checkpoint is not None:
        resumed = make_model()
        resumed.resume_from_checkpoint(checkpoint)
        resumed_losses, _ = steps(resumed, batch, after)
    return {"losses": losses + more_losses, "norms": norms + more_norms, "resumed": resumed_losses, "final": str(final)}
