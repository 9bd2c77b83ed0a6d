"""Under torchrun: build models on meshes they cannot use; each must be refused with a ConfigurationError.

    torchrun --nproc_per_node 2 integration-tests/mesh_refusals.py dense-ep ddp-ep

Rank 0 prints ``REFUSED <case>: <message>`` per case (or ``ACCEPTED <case>``); the test reads the messages.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import twinkle
from twinkle import DeviceMesh
from twinkle.errors import ConfigurationError
from twinkle.model import TransformersModel

WORLD = int(os.environ["WORLD_SIZE"])
DENSE, MOE = "builtin://qwen3-tiny", "builtin://qwen3-moe-tiny"


def _mesh(**sizes: int) -> DeviceMesh:
    return DeviceMesh.from_sizes(world_size=WORLD, **sizes)


CASES: dict[str, Callable[[], object]] = {
    "dense-ep": lambda: TransformersModel(DENSE, device_mesh=_mesh(fsdp_size=WORLD, ep_size=WORLD)),
    "ddp-ep": lambda: TransformersModel(MOE, device_mesh=_mesh(dp_size=WORLD, ep_size=WORLD)),
    "experts-split": lambda: TransformersModel(MOE, device_mesh=_mesh(fsdp_size=WORLD, ep_size=WORLD)),
    "heads-split": lambda: TransformersModel(DENSE, device_mesh=_mesh(fsdp_size=WORLD, ulysses_size=WORLD)),
    "megatron-heads": lambda: _megatron(DENSE, _mesh(tp_size=WORLD)),
    "megatron-layers": lambda: _megatron(DENSE, _mesh(pp_size=WORLD)),
    "megatron-experts": lambda: _megatron(MOE, _mesh(dp_size=WORLD, ep_size=WORLD)),
}


def _megatron(model_id: str, mesh: DeviceMesh) -> object:
    from twinkle.model.megatron import MegatronModel  # the [megatron] extra, for this case only

    return MegatronModel(model_id, device_mesh=mesh)


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
