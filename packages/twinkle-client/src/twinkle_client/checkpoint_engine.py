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
        """Point the sampler at the model's adapter, as the in-process sync would leave it.

        After a LoRA sync the sampler serves the adapter under its name (a sample without ``adapter_name``
        uses it when it is the only one synced); after ``merge_and_sync=True`` its base model is the run's
        merged weights.
        """
        if self.adapter_name is None and not merge_and_sync:
            raise ConfigurationError(
                "the model has no LoRA adapter to sync; use sync_weights(merge_and_sync=True) to push all weights"
            )
        self.sampler.use_model(self.model, self.adapter_name, merged=merge_and_sync)
