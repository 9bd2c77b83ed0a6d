"""What the Tinker SDK tests share: clients pointed at a test server, tiny datums, references from ``forward``."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import tinker
from tinker import types

BASE_MODEL = "builtin://qwen3-tiny"


_OPEN_CLIENTS: list[tinker.ServiceClient] = []


def service_client(server: Any, user: str) -> tinker.ServiceClient:
    """A client of ``user``; :func:`close_clients` ends every one still open (their heartbeats included)."""
    client = tinker.ServiceClient(base_url=server.url, api_key=server.keys[user])
    _OPEN_CLIENTS.append(client)
    return client


def close_clients() -> None:
    """Close the clients made by :func:`service_client`, before the server they talk to stops."""
    while _OPEN_CLIENTS:
        client = _OPEN_CLIENTS.pop()
        with contextlib.suppress(Exception):  # already closed by its test
            client.close("success").result(timeout=30)


def rest_client(server: Any, user: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.url, api_key=server.keys[user])


def sft_datum(seed: int, length: int = 10, weights: list[float] | None = None) -> types.Datum:
    """A next-token datum over random ids: inputs are the sequence minus its last token, targets minus its first."""
    rng = random.Random(seed)
    tokens = [rng.randrange(100, 5000) for _ in range(length + 1)]
    weights = weights if weights is not None else [0.0] * (length // 2) + [1.0] * (length - length // 2)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(seed: int, logprobs: list[float], advantages: list[float], **extra: list[float]) -> types.Datum:
    """A datum for the RL losses: the SFT datum's tokens with sampler log-probs and advantages (numpy inputs)."""
    base = sft_datum(seed, length=len(logprobs))
    inputs = {
        "target_tokens": np.asarray(base.loss_fn_inputs["target_tokens"].data, dtype=np.int64),
        "logprobs": np.asarray(logprobs, dtype=np.float32),
        "advantages": np.asarray(advantages, dtype=np.float32),
        **{name: np.asarray(values, dtype=np.float32) for name, values in extra.items()},
    }
    return types.Datum(model_input=base.model_input, loss_fn_inputs=inputs)


def logprobs_of(output: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [np.asarray(item["logprobs"].to_numpy(), dtype=np.float64) for item in output.loss_fn_outputs]


def weights_of(datum: types.Datum) -> np.ndarray:
    return np.asarray(datum.loss_fn_inputs["weights"].to_numpy(), dtype=np.float64)
