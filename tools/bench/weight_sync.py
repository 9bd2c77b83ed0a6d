"""Weight sync between Ray actors, side by side: the object store against the bucketed broadcast.

```bash
python tools/bench/weight_sync.py                  # Qwen3-0.6B's widths and 28 layers, on CPUs (gloo)
python tools/bench/weight_sync.py --quick          # 4 layers
python tools/bench/weight_sync.py --device cuda    # two GPUs: the broadcast goes over NCCL
```

A ``TransformersModel`` actor with a rank-16 LoRA adapter on every linear layer and a ``TorchSampler``
actor, each on its own device group (one CPU, or one GPU, each). ``CheckpointEngineManager.sync_weights``
moves the adapter alone (``merge_and_sync=False``) and every weight with the adapter merged in
(``merge_and_sync=True``), through the Ray object store (``transport="object_store"``) and by broadcast
(``transport="broadcast"``: gloo between CPUs, NCCL between GPUs); the first sync of each kind is a warm-up
(the broadcast makes its group then), the median of ``--repeats`` after it is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from peft import LoraConfig
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from qwen3_shape import QWEN3_06B, random_qwen3  # a sibling in tools/bench, not a package

import twinkle
from twinkle import DeviceGroup
from twinkle.checkpoint_engine import CheckpointEngineManager
from twinkle.hub import resolve_model
from twinkle.infra import shutdown
from twinkle.model import TransformersModel
from twinkle.sampler import TorchSampler

RANK = 16
_HIDDEN, _HEAD_DIM = QWEN3_06B["hidden_size"], QWEN3_06B["head_dim"]
LINEAR = {  # (in, out) of each adapted projection of a layer
    "q_proj": (_HIDDEN, QWEN3_06B["num_attention_heads"] * _HEAD_DIM),
    "k_proj": (_HIDDEN, QWEN3_06B["num_key_value_heads"] * _HEAD_DIM),
    "v_proj": (_HIDDEN, QWEN3_06B["num_key_value_heads"] * _HEAD_DIM),
    "o_proj": (QWEN3_06B["num_attention_heads"] * _HEAD_DIM, _HIDDEN),
    "gate_proj": (_HIDDEN, QWEN3_06B["intermediate_size"]),
    "up_proj": (_HIDDEN, QWEN3_06B["intermediate_size"]),
    "down_proj": (QWEN3_06B["intermediate_size"], _HIDDEN),
}


def _seconds(manager: CheckpointEngineManager, merge: bool, repeats: int) -> float:
    manager.sync_weights(merge_and_sync=merge)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        manager.sync_weights(merge_and_sync=merge)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 layers instead of --layers")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=256)
    args = parser.parse_args()
    layers = 4 if args.quick else args.layers
    lora_mib = layers * sum(RANK * (i + o) for i, o in LINEAR.values()) * 4 / 2**20
    with tempfile.TemporaryDirectory() as folder:
        path = random_qwen3(Path(folder), layers)
        AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(folder)
        merged_mib = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**20
        groups = [DeviceGroup("model", [0], args.device), DeviceGroup("sampler", [1], args.device)]
        twinkle.initialize(mode="ray", seed=0, groups=groups, lazy_collect=False, num_cpus=2)
        try:
            model = TransformersModel(model_id=path, remote_group="model", device=args.device)
            model.add_adapter_to_model("default", LoraConfig(r=RANK, target_modules="all-linear"), seed=0)
            sampler = TorchSampler(model_id=path, remote_group="sampler", device=args.device)
            results = {}
            for transport in ("object_store", "broadcast"):
                manager = CheckpointEngineManager(model, sampler, transport=transport, bucket_mb=args.bucket_mb)
                results[transport] = [_seconds(manager, merge, args.repeats) for merge in (False, True)]
        finally:
            shutdown()
    wire = "NCCL" if args.device == "cuda" else "gloo"
    print(f"weight sync between two Ray actors on {args.device}, {layers} layers of Qwen3-0.6B's widths:")
    for index, (what, mib) in enumerate((("LoRA only", lora_mib), ("merged", merged_mib))):
        store, broadcast = results["object_store"][index], results["broadcast"][index]
        print(
            f"  {what:9s} {mib:8.1f} MiB: object store {store:7.3f} s, broadcast ({wire}) {broadcast:7.3f} s, "
            f"object store / broadcast {store / broadcast:5.2f}"
        )


if __name__ == "__main__":
    main()
