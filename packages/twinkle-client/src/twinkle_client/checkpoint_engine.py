"""``CheckpointEngineManager`` over HTTP: nothing to move, by design.

In-process, RL copies the trainer's LoRA tensors (or merged weights) into a
separate sampler before each sampling round. On a Twinkle server the sampler and
the trainer share one base model and the runs' live adapter tensors, so a sample
with ``adapter_name=<the run's adapter>`` already uses the latest weights, and
copying them would only cost time. ``sync_weights`` therefore only records which
run the sampler uses, keeping cookbooks written for in-process training unchanged.
"""

from __future__ import annotations

from twinkle.errors import ConfigurationError
from twinkle.utils import pick_adapter
from twinkle_client.model import TransformersModel
from twinkle_client.sampler import TorchSampler


class CheckpointEngineManager:
    """Points ``sampler`` at ``model``'s adapter (its only one unless ``adapter_name`` is given)."""

    def __init__(self, model: TransformersModel, sampler: TorchSampler, adapter_name: str | None = None) -> None:
        self.model = model
        self.sampler = sampler
        self.adapter_name = pick_adapter(model.adapter_names, adapter_name)

    def sync_weights(self, merge_and_sync: bool = False) -> None:
        """Let the sampler resolve the model's adapter names; after ``merge_and_sync=True`` a sample without
        ``adapter_name`` uses the synced adapter too, as a sampler holding the merged weights would."""
        if self.adapter_name is None and not merge_and_sync:
            raise ConfigurationError(
                "the model has no LoRA adapter to sync; use sync_weights(merge_and_sync=True) to push all weights"
            )
        run_id = self.model.run_id(self.adapter_name)
        self.sampler.use_model(self.model, default_run=run_id if merge_and_sync else None)
