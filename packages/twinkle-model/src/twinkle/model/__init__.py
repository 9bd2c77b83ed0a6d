"""Training back-ends behind the semantic model API (``forward_backward``, ``clip_grad_and_step``, ``save``...)."""

from twinkle.model.transformers_model import TransformersModel

__all__ = ["TransformersModel"]
