"""Chat-template encoding: :class:`Template` turns trajectories into token ids with assistant-only labels."""

from twinkle.template.errors import SequenceTooLongError, TemplateError
from twinkle.template.template import Template
from twinkle.template.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    detect_tool_parser,
)
from twinkle.template.truncation import TRUNCATION_STRATEGIES, TruncationStrategy

__all__ = [
    "TRUNCATION_STRATEGIES",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "SequenceTooLongError",
    "Template",
    "TemplateError",
    "TruncationStrategy",
    "detect_tool_parser",
]
