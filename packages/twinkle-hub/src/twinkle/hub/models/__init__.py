"""Builders of the ``builtin://`` models (weights, config, tokenizer, chat template)."""
