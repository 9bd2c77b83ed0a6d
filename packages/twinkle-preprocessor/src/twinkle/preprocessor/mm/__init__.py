"""Preprocessors for image datasets (vision-language models)."""

from twinkle.preprocessor.mm.clevr import CLEVR_INSTRUCTION, CLEVRProcessor

__all__ = ["CLEVR_INSTRUCTION", "CLEVRProcessor"]
