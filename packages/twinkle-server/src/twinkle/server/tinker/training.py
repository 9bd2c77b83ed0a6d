"""The work behind Tinker's training calls, run by the pool that holds the run (as ``FunctionTask`` s).

Each function taking the pool returns the reply as stored for ``retrieve_future``. Models are
LoRA adapters on the shared base (``MultiLoraModel``), named by their Tinker
model id; their optimizer is AdamW, whose hyper-parameters come with every
``optim_step``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from twinkle.errors import InvalidInputError
from twinkle.model import TargetSequence, TargetsOutput, TargetsRequest, check_sequences
from twinkle.server.services.engine import Engine, Task
from twinkle.server.services.pool import ModelPool
from twinkle.server.tinker.codec import ForwardBackwardCall, encode_forward_backward_output
from twinkle.server.tinker.images import expand_images
from twinkle.server.tinker.losses import build_loss, targets_of
from twinkle.server.tinker.replies import json_result, proto_result

# Tinker's AdamParams defaults; the optimizer is created with them and updated on every step.
ADAM_DEFAULTS: dict[str, Any] = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-12, "weight_decay": 0.0}
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
OUTPUT_LAYER = "lm_head"  # the unembedding of transformers causal LMs (tied or not: LoRA adapts the output only)
LORA_ALPHA = 32  # Tinker fixes alpha; only the rank is the user's choice


def lora_config(rank: int, train_attn: bool, train_mlp: bool, train_unembed: bool) -> dict[str, Any]:
    """The PEFT ``LoraConfig`` fields for a Tinker ``LoraConfig``."""
    targets = [
        *(ATTENTION_MODULES if train_attn else ()),
        *(MLP_MODULES if train_mlp else ()),
        *((OUTPUT_LAYER,) if train_unembed else ()),
    ]
    if not targets:
        raise InvalidInputError(
            "train_attn, train_mlp and train_unembed are all false: the adapter would train nothing"
        )
    return {"r": rank, "lora_alpha": LORA_ALPHA, "target_modules": targets}


def create_model(
    pool: ModelPool, run_id: str, config: Mapping[str, Any], seed: int | None, then: Task | None = None
) -> bytes:
    """Add the run's adapter and optimizer; ``then`` (a load) runs right after and makes the reply."""
    try:
        pool.add_run(run_id, config, seed=seed)
        pool.model.set_optimizer("AdamW", adapter_name=run_id, **ADAM_DEFAULTS)
        return json_result({"model_id": run_id, "type": "create_model"}) if then is None else then.apply(pool)
    except Exception:
        pool.remove_run(run_id)
        raise


def sequences_of(call: ForwardBackwardCall) -> list[TargetSequence]:
    sequences = []
    for i, datum in enumerate(call.data):
        tokens = torch.as_tensor(datum.tokens, dtype=torch.long)
        targets = torch.as_tensor(targets_of(datum, i)).long()
        # Only image datums carry features (their pixel values and vision-token types).
        extra = {"features": datum.features} if datum.features else {}
        sequences.append(TargetSequence(tokens, targets, **extra))
    return sequences


def checked_request(engine: Engine, call: ForwardBackwardCall, model_id: str) -> TargetsRequest:
    """The call as a request of a shared pass (its sequences, its Tinker loss, which sums over tokens, and its
    mode), once everything that can be checked before it queues is (the caller gets a 400 now).

    Image chunks become their vision tokens and pixel values here (``model_id`` names the model in errors).
    """
    if not call.data:
        raise InvalidInputError("forward_backward needs at least one datum")
    for index, datum in enumerate(call.data):
        expand_images(datum, engine.model_path, model_id, f"data[{index}].model_input")
    loss_fn = build_loss(call.loss_fn, call.loss_fn_config, call.data)
    sequences = sequences_of(call)
    check_sequences(sequences, engine.vocab_size, engine.max_length, label="data")
    return TargetsRequest(call.model_id, sequences, loss_fn, backward=not call.forward_only)


def forward_backward(pool: ModelPool, request: TargetsRequest) -> TargetsOutput:
    """The call alone (a shared pass of one)."""
    output = pool.forward_backward_many([request])[0].unwrap()
    assert isinstance(output, TargetsOutput)
    return output


def encode_output(output: TargetsOutput) -> bytes:
    """The reply to ``retrieve_future``: per-datum log-probs and the loss's metrics."""
    logps = [lp.float().numpy() for lp in output.logps]
    return proto_result(encode_forward_backward_output(logps, output.metrics))


def optim_step(pool: ModelPool, run_id: str, params: Mapping[str, float]) -> bytes:
    """AdamW with this step's hyper-parameters; ``grad_clip_norm`` 0 means no clipping."""
    model = pool.model
    lr = float(params.get("learning_rate", ADAM_DEFAULTS["lr"]))
    model.update_optimizer(
        adapter_name=run_id,
        lr=lr,
        betas=(float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95))),
        eps=float(params.get("eps", ADAM_DEFAULTS["eps"])),
        weight_decay=float(params.get("weight_decay", 0.0)),
    )
    clip = float(params.get("grad_clip_norm", 0.0))
    grad_norm = model.clip_grad_norm(clip if clip > 0 else math.inf, adapter_name=run_id)
    if not math.isfinite(grad_norm):
        model.zero_grad(adapter_name=run_id)
        raise InvalidInputError(
            f"the gradient norm is {grad_norm}: the step was skipped and the gradients dropped (weights unchanged)"
        )
    model.step(adapter_name=run_id)
    model.zero_grad(adapter_name=run_id)
    return json_result({"metrics": {"grad_norm:mean": grad_norm, "learning_rate:mean": lr}, "type": "optim_step"})
