"""How a model's computations run across processes (one, or DDP / FSDP2 under torchrun), and the global batch.

:mod:`~twinkle.model.parallel.plans` wraps the model and runs its forwards;
:mod:`~twinkle.model.parallel.global_batch` turns every rank's share of a batch
into the global batch's loss normaliser and metrics;
:mod:`~twinkle.model.parallel.tensors` holds the ``torch.distributed`` helpers.
"""

from twinkle.model.parallel.global_batch import Denominator, global_denominator, record_call
from twinkle.model.parallel.plans import DataParallel, Parallelism, parallelism_for
from twinkle.model.parallel.tensors import full_tensors, local_device, shard_optimizer_state

__all__ = [
    "DataParallel",
    "Denominator",
    "Parallelism",
    "full_tensors",
    "global_denominator",
    "local_device",
    "parallelism_for",
    "record_call",
    "shard_optimizer_state",
]
