"""Self-cognition rows (``{query, response, tag?}`` with ``{{NAME}}``/``{{AUTHOR}}`` placeholders) to chats."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Trajectory
from twinkle.errors import InvalidInputError
from twinkle.interfaces import Preprocessor
from twinkle.preprocessor.columns import text_column
from twinkle.registry import register


@register("preprocessor")
class SelfCognitionProcessor(Preprocessor):
    """Teaches a model its new identity: placeholders become ``model_name`` and ``model_author``.

    ``SelfCognitionProcessor('twinkle模型', 'twinkle团队')`` turns "我是{{NAME}}，由{{AUTHOR}}开发"
    into "我是twinkle模型，由twinkle团队开发"; the query is filled in the same way.
    """

    def __init__(self, model_name: str, model_author: str) -> None:
        for argument, value in (("model_name", model_name), ("model_author", model_author)):
            if not isinstance(value, str) or not value.strip():
                raise InvalidInputError(f"SelfCognitionProcessor: {argument} must be a non-empty string, got {value!r}")
        self.model_name = model_name
        self.model_author = model_author

    def preprocess(self, row: Mapping[str, Any]) -> Trajectory:
        name = type(self).__name__
        query = self._fill(text_column(row, "query", name))
        response = self._fill(text_column(row, "response", name))
        return {"messages": [{"role": "user", "content": query}, {"role": "assistant", "content": response}]}

    def _fill(self, text: str) -> str:
        return text.replace("{{NAME}}", self.model_name).replace("{{AUTHOR}}", self.model_author)
