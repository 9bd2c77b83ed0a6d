"""The torchrun workers' shared run: 4 steps with a checkpoint after the second, then steps 3-4 again from it."""

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


def train_save_resume(make_model: Callable[[], Any], batch: list[dict[str, Any]], output_dir: Path) -> dict[str, Any]:
    """Losses and norms of 4 steps, the losses of steps 3-4 resumed in a fresh model, and the final weights' path."""
    model = make_model()
    losses, norms = steps(model, batch, 2)
    checkpoint = model.save("step-2", output_dir=output_dir)
    more_losses, more_norms = steps(model, batch, 2)
    final = model.save("final", output_dir=output_dir, save_optimizer=False)
    resumed = make_model()
    resumed.resume_from_checkpoint(checkpoint)
    resumed_losses, _ = steps(resumed, batch, 2)
    return {"losses": losses + more_losses, "norms": norms + more_norms, "resumed": resumed_losses, "final": str(final)}
