"""Twinkle client: drive a remote Twinkle server with the same API as in-process training.

Change ``from twinkle.X import Y`` to ``from twinkle_client.X import Y``, call
:func:`init_twinkle_client` once, and the training loop runs unchanged: models,
samplers, datasets and data loaders become proxies of server objects, while
rewards, advantages, metrics and preprocessors run locally (none needs torch).
"""

from twinkle_client.context import get_client, init_twinkle_client
from twinkle_client.http import TwinkleClient
from twinkle_client.lora import LoraConfig

__version__ = "0.1.0"

__all__ = ["LoraConfig", "TwinkleClient", "get_client", "init_twinkle_client"]
