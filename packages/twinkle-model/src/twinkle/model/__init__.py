"""Training back-ends behind the semantic model API (``forward_backward``, ``clip_grad_and_step``, ``save``...).

``TransformersModel`` trains one adapter (PEFT) or all weights per call;
``MultiLoraModel`` trains many tenants' adapters together in shared passes.
"""

from twinkle.model.multi_lora_model import MultiLoraModel
from twinkle.model.shared_pass import AdapterRequest, AdapterResult
from twinkle.model.targets import TargetSequence, TargetsOutput, target_logps
from twinkle.model.training_model import TrainingModel
from twinkle.model.transformers_model import TransformersModel

__all__ = [
    "AdapterRequest",
    "AdapterResult",
    "MultiLoraModel",
    "TargetSequence",
    "TargetsOutput",
    "TrainingModel",
    "TransformersModel",
    "target_logps",
]
