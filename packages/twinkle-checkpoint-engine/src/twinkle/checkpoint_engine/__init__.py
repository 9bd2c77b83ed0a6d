"""Weight sync from a trainer to a sampler: ``CheckpointEngineManager(model, sampler).sync_weights()``."""

from twinkle.checkpoint_engine.manager import CheckpointEngineManager, WeightReceiver
from twinkle.checkpoint_engine.weights import lora_payload, merged_weights

__all__ = ["CheckpointEngineManager", "WeightReceiver", "lora_payload", "merged_weights"]
