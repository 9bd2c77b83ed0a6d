"""Where the seeds' Tinker scripts import their data converters from (``twinkle.server.tinker.common``).

The converters belong to the client side (``twinkle_client.tinker``, which
needs no torch); this module re-exports them so scripts written against that
import path run unchanged. New code imports them from ``twinkle_client``.
"""

from twinkle_client import datum_to_input_feature, input_feature_to_datum

__all__ = ["datum_to_input_feature", "input_feature_to_datum"]
