"""Preprocessors for text-only LLM datasets (chat, instruction, math, preference)."""

from twinkle.preprocessor.llm.alpaca import AlpacaProcessor
from twinkle.preprocessor.llm.dpo import DPOProcessor
from twinkle.preprocessor.llm.gsm8k import GSM8K_SYSTEM, GSM8KProcessor
from twinkle.preprocessor.llm.messages import MessagesProcessor, normalize_messages
from twinkle.preprocessor.llm.self_cognition import SelfCognitionProcessor

__all__ = [
    "GSM8K_SYSTEM",
    "AlpacaProcessor",
    "DPOProcessor",
    "GSM8KProcessor",
    "MessagesProcessor",
    "SelfCognitionProcessor",
    "normalize_messages",
]
