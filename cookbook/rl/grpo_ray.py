"""GRPO with the model and the sampler on their own Ray device groups: the seed's Ray listing, on a CPU.

cookbook/rl/grpo.py's recipe and loop, imported, not copied: only
``twinkle.initialize(mode='ray', groups=[...])`` and the ``remote_group=``
of the model (the warm-up's too) and the sampler differ. They run as Ray
actors, one CPU each; the dataset, rewards, advantages and metrics stay in
this driver process. ``sync_weights`` moves the LoRA tensors from the model's
actor to the sampler's through the Ray object store, not through the driver.

    python cookbook/rl/grpo_ray.py

Without ``RAY_ADDRESS`` a local Ray is started that listens on 127.0.0.1 only,
and stopped at the end. The environment knobs are grpo.py's; with the same
SEED the rewards equal the in-process run's.
"""

import time

from grpo import SEED, build_model, build_sampler, local_components, train, warm_up_checkpoint

import twinkle
from twinkle import DeviceGroup, get_device_placement
from twinkle.infra import shutdown


def main() -> None:
    device_groups = [
        DeviceGroup(name="model", ranks=[0], device_type="cpu"),
        DeviceGroup(name="sampler", ranks=[1], device_type="cpu"),
    ]
    twinkle.initialize(mode="ray", seed=SEED, groups=device_groups, lazy_collect=False)
    try:
        started = time.perf_counter()
        components = local_components()
        base_model = warm_up_checkpoint(components, remote_group="model")
        model = build_model(components, base_model, remote_group="model")
        sampler = build_sampler(components, base_model, remote_group="sampler")
        print(get_device_placement())
        train(components, model, sampler, started)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
