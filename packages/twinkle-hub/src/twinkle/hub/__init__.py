"""Resolve model and dataset ids (local paths, ``hf://``, ``ms://``, ``builtin://``) to local data.

Importing this package is cheap: transformers, huggingface_hub and modelscope are
imported only by the call that needs them.
"""

from twinkle.hub.registry import is_builtin, list_builtin
from twinkle.hub.resolve import resolve_dataset, resolve_model

__all__ = ["is_builtin", "list_builtin", "resolve_dataset", "resolve_model"]
