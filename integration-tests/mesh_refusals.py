"""Under torchrun: build models on meshes they cannot use; each must be refused with a ConfigurationError.

    torchrun --nproc_per_node 2 integration-tests/mesh_refusals.py dense-ep ddp-ep

Rank 0 prints ``REFUSED <case>: <message>`` per case (or ``ACCEPTED <case>``); the test reads the messages.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from peft import LoraConfig

import twinkle
from twinkle import DeviceMesh
from twinkle.errors import ConfigurationError
from twinkle.model import TransformersModel

WORLD = int(os.environ["WORLD_SIZE"])
DENSE, MOE = "builtin://qwen3-tiny", "builtin://qwen3-moe-tiny"


def _mesh(**sizes: int) -> DeviceMesh:
    return DeviceMesh.from_sizes(world_size=WORLD, **sizes)


def _trained(model_id: str, mesh: DeviceMesh, lora: LoraConfig | None) -> None:
    model = TransformersModel(model_id, device_mesh=mesh)
    if lora is not None:
        model.add_adapter_to_model("default", lora)
    model.set_optimizer("AdamW", lr=1e-3)  # the model is wrapped (FSDP2) here, before any weight changes


CASES: dict[str, Callable[[], object]] = {
    "dense-ep": lambda: TransformersModel(DENSE, device_mesh=_mesh(fsdp_size=WORLD, ep_size=WORLD)),
    "ddp-ep": lambda: TransformersModel(MOE, device_mesh=_mesh(dp_size=WORLD, ep_size=WORLD)),
    "experts-lora": lambda: _trained(
        MOE, _mesh(fsdp_size=WORLD, ep_size=WORLD), LoraConfig(r=4, target_modules="all-linear")
    ),
    "full-ep": lambda: _trained(MOE, _mesh(fsdp_size=WORLD, ep_size=WORLD), None),
    "experts-split": lambda: TransformersModel(MOE, device_mesh=_mesh(fsdp_size=WORLD, ep_size=WORLD)),
    "heads-split": lambda: TransformersModel(DENSE, device_mesh=_mesh(fsdp_size=WORLD, ulysses_size=WORLD)),
}


def main(cases: list[str]) -> None:
    twinkle.initialize(seed=0)
    for case in cases:
        try:
            CASES[case]()
        except ConfigurationError as error:
            outcome = f"REFUSED {case}: {error}"
        else:
            outcome = f"ACCEPTED {case}"
        if twinkle.is_master():
            print(outcome, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
