"""Chat-template encoding: :class:`Template` turns trajectories into token ids with assistant-only labels.

A vision-language model's images go through :class:`ImageEncoder` (its image processor and image token),
which the server also uses on images that arrive as Tinker image chunks.
"""

from twinkle.template.errors import SequenceTooLongError, TemplateError
from twinkle.template.template import Template
from twinkle.template.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    detect_tool_parser,
)
from twinkle.template.truncation import TRUNCATION_STRATEGIES, TruncationStrategy
from twinkle.template.vision import IMAGE_PLACEHOLDER, ImageEncoder, checked_trajectory_images, load_image

__all__ = [
    "IMAGE_PLACEHOLDER",
    "TRUNCATION_STRATEGIES",
    "HermesToolParser",
    "ImageEncoder",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "SequenceTooLongError",
    "Template",
    "TemplateError",
    "TruncationStrategy",
    "checked_trajectory_images",
    "detect_tool_parser",
    "load_image",
]
