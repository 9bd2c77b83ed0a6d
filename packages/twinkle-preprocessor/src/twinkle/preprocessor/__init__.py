"""Preprocessors: raw dataset rows to :class:`~twinkle.data_format.Trajectory` rows.

Every class here implements :class:`twinkle.interfaces.Preprocessor` and is
registered under its class name (entry-point group ``twinkle.preprocessor``),
so ``dataset.map('GSM8KProcessor')`` works without importing this package.
Rows that cannot be converted raise :class:`~twinkle.errors.InvalidInputError`
naming the column. This package imports neither torch nor transformers.
"""

from twinkle.preprocessor.function import FunctionPreprocessor, as_preprocessor
from twinkle.preprocessor.llm import (
    GSM8K_SYSTEM,
    AlpacaProcessor,
    DPOProcessor,
    GSM8KProcessor,
    MessagesProcessor,
    SelfCognitionProcessor,
    normalize_messages,
)
from twinkle.preprocessor.mm import CLEVR_INSTRUCTION, CLEVRProcessor

__all__ = [
    "CLEVR_INSTRUCTION",
    "GSM8K_SYSTEM",
    "AlpacaProcessor",
    "CLEVRProcessor",
    "DPOProcessor",
    "FunctionPreprocessor",
    "GSM8KProcessor",
    "MessagesProcessor",
    "SelfCognitionProcessor",
    "as_preprocessor",
    "normalize_messages",
]
