"""A few short chat turns, encoded by a model's template: the training batch of the model-family tests."""

from __future__ import annotations

from typing import Any

from twinkle.template import Template

CONVERSATIONS = [
    ("Who are you?", "I am Twinkle, a small model trained by ModelScope."),
    ("What is 2 + 3?", "2 + 3 = 5."),
    ("Name a colour.", "Blue."),
    ("Say hello in French.", "Bonjour!"),
]


def encoded_conversations(model_id: str) -> list[dict[str, Any]]:
    """:data:`CONVERSATIONS` as ``model_id``'s template encodes them (one user and one assistant turn each)."""
    template = Template(model_id, max_length=64)
    return [
        template.encode({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        for q, a in CONVERSATIONS
    ]
