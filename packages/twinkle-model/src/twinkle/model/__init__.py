"""Training back-ends behind the semantic model API (``forward_backward``, ``clip_grad_and_step``, ``save``...).

``TransformersModel`` trains one adapter (PEFT) or all weights per call;
``MultiLoraModel`` trains many tenants' adapters together in shared passes
(``SharedPasses``, which the Megatron back-end's ``MultiLoraMegatronModel`` shares).
All run every call through one pass engine (:mod:`twinkle.model.passes`).
"""

from twinkle.model.checkpoints.files import atomic_directory
from twinkle.model.multi_lora_model import MultiLoraModel
from twinkle.model.passes.logps import target_logps
from twinkle.model.passes.loss_inputs import check_loss_inputs
from twinkle.model.passes.requests import (
    AdapterRequest,
    AdapterResult,
    LossFn,
    PassRequest,
    TargetSequence,
    TargetsOutput,
    TargetsRequest,
    check_sequences,
)
from twinkle.model.shared_passes import SharedPasses
from twinkle.model.training_model import TrainingModel
from twinkle.model.transformers_model import TransformersModel

__all__ = [
    "AdapterRequest",
    "AdapterResult",
    "LossFn",
    "MultiLoraModel",
    "PassRequest",
    "SharedPasses",
    "TargetSequence",
    "TargetsOutput",
    "TargetsRequest",
    "TrainingModel",
    "TransformersModel",
    "atomic_directory",
    "check_loss_inputs",
    "check_sequences",
    "target_logps",
]
