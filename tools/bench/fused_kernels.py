"""Kernels side by side, in one run: fused log-probs vs the plain ``[T, V]`` log-softmax, multi-LoRA vs a loop.

```bash
python tools/bench/fused_kernels.py           # vocab 151,936 × 8,192 tokens; about 2.5 minutes and 16 GB on CPU
python tools/bench/fused_kernels.py --quick   # 1,024 tokens, smoke run
```

On CPU the Twinkle side of the log-probs is ``twinkle.module.chunked_token_logps`` over ``--chunk-size``
tokens at a time (the path models take there, with ``logps_chunk_size``), on CUDA the Triton kernel; the
multi-LoRA kernel is timed on CUDA only (the interpreter that runs it on CPU is for tests). Target: the fused
log-probs' peak memory at most 1/8 of the plain one's. In ``--quick`` runs on CPU the chunked path keeps the
probabilities for its backward (they fit its 4 GiB budget), so the target applies to the full size. On CUDA
it then times each kernel against its PyTorch reference and Liger's (``kernels_each.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernels_each import print_each_kernel  # siblings in tools/bench, not a package
from kernels_logps import bench_linear_logps
from kernels_lora import bench_multi_lora


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 tokens instead of 8,192")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--chunk-size", type=int, default=1024, help="tokens per chunk of the CPU path")
    args = parser.parse_args()
    tokens = 1024 if args.quick else 8192
    logps = bench_linear_logps(tokens, 151_936, 64, args.device, chunk_size=args.chunk_size)
    plain, fused = logps["plain"], logps["twinkle"]
    print(f"log-probs, {tokens} tokens × vocab 151,936 on {args.device} ({fused['impl']}):")
    print(f"  plain   peak {plain['peak_bytes'] / 2**20:9.1f} MiB  {plain['seconds'] * 1e3:8.1f} ms")
    print(f"  twinkle peak {fused['peak_bytes'] / 2**20:9.1f} MiB  {fused['seconds'] * 1e3:8.1f} ms")
    ratio = fused["peak_bytes"] / max(plain["peak_bytes"], 1)
    print(
        f"  peak memory ratio twinkle/plain: {ratio:.3f} (target ≤ 0.125); time ratio plain/twinkle: "
        f"{plain['seconds'] / fused['seconds']:.2f}; max |Δ logp| {logps['max_logps_diff']:.2e}"
    )
    lora = bench_multi_lora(4096 if not args.quick else 512, 1024, 1024, 8, 16, args.device)
    print(f"multi-LoRA, 8 adapters: {lora}")
    if torch.device(args.device).type == "cuda":
        print_each_kernel()


if __name__ == "__main__":
    main()
