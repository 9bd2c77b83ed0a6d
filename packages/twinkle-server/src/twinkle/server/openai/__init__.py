"""The OpenAI-compatible API of the Twinkle server: ``GET /v1/models`` and ``POST /v1/chat/completions``."""
