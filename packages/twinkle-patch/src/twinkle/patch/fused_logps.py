"""A causal LM whose loss comes from hidden states through the fused linear + log-prob kernel, never from logits.

transformers' ``forward(..., labels=...)`` builds the ``[B, T, V]`` logits
and their log-softmax before the cross-entropy: 20 GB for 8 × 4096 tokens of
a 151k vocabulary in float32. Patched, a forward with ``labels`` runs the
decoder, hands the hidden states of the labelled positions and the output
layer's weight to ``twinkle.kernel``'s ``TritonLinearLogps`` (chunked over
tokens and vocabulary), and returns the same loss with ``logits=None``. Without
labels the forward is the model's own. Where the kernel cannot run (no triton,
no CUDA) it falls back to its reference, which does build the logits.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from twinkle.data_format import IGNORE_INDEX
from twinkle.errors import ConfigurationError
from twinkle.interfaces import Patch
from twinkle.kernel import TritonLinearLogps
from twinkle.registry import register


@register("patch")
class FusedLinearLogpsPatch(Patch):
    """The fused-log-prob loss for a transformers causal LM with a bias-free linear output layer."""

    name: ClassVar[str] = "FusedLinearLogpsPatch"

    def check(self, target: Any) -> None:
        head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
        if not hasattr(target, "get_decoder") or type(head) is not torch.nn.Linear or head.bias is not None:
            raise ConfigurationError(
                f"{self.name} patches a transformers causal LM whose output layer is a bias-free nn.Linear; "
                f"{type(target).__name__} is not one"
            )

    def apply(self, target: Any) -> Callable[[], None]:
        forward = target.forward
        kernel = TritonLinearLogps()

        signature = inspect.signature(forward)

        def fused_forward(*args: Any, **kwargs: Any) -> Any:
            arguments = signature.bind(*args, **kwargs).arguments
            labels = arguments.pop("labels", None)
            if labels is None:
                return forward(*args, **kwargs)
            arguments.update(arguments.pop("kwargs", {}))  # the forward's own **kwargs
            num_items_in_batch = arguments.pop("num_items_in_batch", None)
            arguments.pop("logits_to_keep", None)  # no logits are computed at all
            hidden_BTH = target.get_decoder()(**arguments).last_hidden_state
            labels_BT = labels[:, 1:].to(hidden_BTH.device)  # the hidden state at t-1 predicts the label at t
            supervised_BT = labels_BT != IGNORE_INDEX
            hidden_NH = hidden_BTH[:, :-1][supervised_BT]
            weight_VH = target.get_output_embeddings().weight
            logps_N = kernel(hidden_NH, weight_VH.to(hidden_NH.dtype), labels_BT[supervised_BT]).logps
            # transformers' own reduction: a mean over labelled tokens, or over the trainer's count.
            denominator = num_items_in_batch if num_items_in_batch is not None else supervised_BT.sum()
            return CausalLMOutputWithPast(loss=-logps_N.sum() / denominator, logits=None)

        target.forward = fused_forward

        def undo() -> None:
            del target.forward

        return undo
