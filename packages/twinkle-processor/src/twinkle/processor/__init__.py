"""Collating encoded features into model tensors: padded ``[B, T]`` or padding-free ``[1, ΣT]``.

``InputProcessor`` builds the batch; ``model_inputs`` turns it into the keyword
arguments of a transformers forward; ``unpack`` splits per-token results
(logits, log-probs) back into one tensor per feature, whichever the layout.
"""

from twinkle.processor.batch import model_inputs, select_rows, unpack
from twinkle.processor.input_processor import InputProcessor

__all__ = ["InputProcessor", "model_inputs", "select_rows", "unpack"]
