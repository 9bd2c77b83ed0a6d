"""What batching sample calls buys a ``twinkle server``: an RL loop's rollouts through the ``tinker`` SDK.

An RL loop on Tinker samples its prompts' groups as concurrent ``asample`` requests (one prompt each,
``num_samples`` completions, a seed each), then waits for all of them. This script sends such rollouts to two
real ``twinkle server`` processes started here (127.0.0.1 only, checked with ``ss -tnlp``; stopped at the end
whatever happens), side by side, the first one alternating round by round:

- **batched**: the default scheduler, which generates every sample call queued when it turns to them in one
  ``Sampler.sample_many`` batch;
- **one at a time**: ``max_tokens_per_pass: 0``, whose scheduler runs every call alone.

Tokens/s counts the completion tokens every request got back, over the wall time from the first request sent
until the last answer; the median over ``--rounds`` is reported, with the ratio and the sample calls per
batch read from each server's ``/metrics``. Both servers sample the embedded ``builtin://qwen3-tiny``
(float32) with the same requests: temperature 1, ``--max-tokens`` new tokens, seeds 0..``--requests``.

    python tools/bench/server_sampling.py           # about 2 minutes on 2 idle CPU cores
    python tools/bench/server_sampling.py --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from server_procs import MODEL_ID, Server, check_loopback_only  # a sibling (run from here)

SERVERS = {"batched": {}, "one at a time": {"max_tokens_per_pass": 0}}


def rollout(sampler: Any, requests: int, samples: int, max_tokens: int) -> int:
    """One rollout: ``requests`` concurrent sample requests, all awaited; the completion tokens they got."""
    from tinker import types

    futures = [
        sampler.sample(
            types.ModelInput.from_ints([151644, 872, 198, 100 + index * 37]),
            samples,
            types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=index),
        )
        for index in range(requests)
    ]
    return sum(len(sequence.tokens) for future in futures for sequence in future.result().sequences)


def sample_batches(server: Server) -> tuple[float, float]:
    """``(sample calls, batches)`` the server ran so far, from ``/metrics``."""
    values = {"twinkle_sample_batch_requests_sum": 0.0, "twinkle_sample_batch_requests_count": 0.0}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return values["twinkle_sample_batch_requests_sum"], values["twinkle_sample_batch_requests_count"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="concurrent sample requests per rollout")
    parser.add_argument("--samples", type=int, default=4, help="completions per request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="timed rollouts per server; the median is reported")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in each server")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 requests of 8 tokens, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.rounds = 8, 8, 2
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import tinker

    args = parse_args(argv)
    print(
        f"model {MODEL_ID}; {args.requests} concurrent requests x {args.samples} samples x {args.max_tokens} tokens "
        f"per rollout, {args.threads} torch threads in each server; load average {os.getloadavg()[0]:.1f}"
    )
    key = f"tml-{secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-sampling-") as root, contextlib.ExitStack() as stack:
        servers = {
            name: Server(name.replace(" ", "-"), Path(root), {"bench": key}, args.threads, **options)
            for name, options in SERVERS.items()
        }
        for server in servers.values():
            stack.callback(server.stop)
        samplers = {}
        for name, server in servers.items():
            server.wait_ready()
            check_loopback_only(server)
            client = tinker.ServiceClient(base_url=server.url, api_key=key)
            stack.callback(lambda client=client: client.close("success").result(timeout=30))
            samplers[name] = client.create_sampling_client(base_model=MODEL_ID).result()
            rollout(samplers[name], args.requests, args.samples, args.max_tokens)  # warm-up, untimed
        before = {name: sample_batches(server) for name, server in servers.items()}
        speeds: dict[str, list[float]] = {name: [] for name in servers}
        for index in range(args.rounds):
            for name in list(servers) if index % 2 == 0 else list(reversed(servers)):
                start = time.perf_counter()
                tokens = rollout(samplers[name], args.requests, args.samples, args.max_tokens)
                speeds[name].append(tokens / (time.perf_counter() - start))
        median = {name: statistics.median(values) for name, values in speeds.items()}
        for name, server in servers.items():
            calls, batches = (now - then for now, then in zip(sample_batches(server), before[name], strict=True))
            rounds = ", ".join(f"{value:.0f}" for value in speeds[name])
            print(
                f"  {name:<14} {median[name]:>7.0f} tokens/s   (rounds: {rounds}); "
                f"{calls / max(batches, 1):.1f} sample calls per batch"
            )
        print(f"  ratio batched / one at a time: {median['batched'] / median['one at a time']:.2f}")


if __name__ == "__main__":
    main()
