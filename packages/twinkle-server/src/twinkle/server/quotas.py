"""Per-user limits: adapters, LoRA rank, tokens and images per request, image size and request rate.

Each user gets the config's default ``quotas`` with their own overrides
(``users.<name>.quotas``) on top. Every refusal names the limit and the numbers,
so a tenant knows what to change; quota refusals map to HTTP 403 and rate
refusals (``RateLimitError``) to 429.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from twinkle.errors import QuotaExceededError, RateLimitError
from twinkle.server.config import Quotas, ServerConfig


class QuotaChecker:
    """Checks requests against per-user quotas; the rate limiter is a token bucket per user.

    A bucket holds up to one second's worth of requests (at least one) and
    refills continuously, so a client may burst briefly but not sustain more
    than ``requests_per_second``. ``clock`` must be monotonic (tests inject a fake).
    """

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # user -> (tokens, time of last update)

    def limits(self, user: str) -> Quotas:
        return self._config.quotas_for(user)

    def check_new_adapter(self, user: str, current_count: int, rank: int) -> None:
        """Before creating (or making resident again) one more adapter of ``rank`` for ``user``."""
        limits = self.limits(user)
        if current_count >= limits.max_adapters:
            raise QuotaExceededError(
                f"user {user!r} already has {current_count} adapter(s) loaded; quota max_adapters is "
                f"{limits.max_adapters} (closing a session unloads its runs' adapters)",
                "max_adapters",
            )
        if rank > limits.max_rank:
            raise QuotaExceededError(
                f"LoRA rank {rank} exceeds the quota max_rank {limits.max_rank} of user {user!r}", "max_rank"
            )

    def check_tokens(self, user: str, n_tokens: int) -> None:
        limit = self.limits(user).max_tokens_per_request
        if n_tokens > limit:
            raise QuotaExceededError(
                f"request has {n_tokens} tokens; the quota max_tokens_per_request of user {user!r} is {limit}",
                "max_tokens_per_request",
            )

    def check_sampling(self, user: str, prompt_tokens: int, n_prompts: int, max_tokens: int, num_samples: int) -> None:
        """A sampling request's tokens: its prompts and the most each sample may generate, for every sample."""
        self.check_tokens(user, (prompt_tokens + n_prompts * max_tokens) * num_samples)

    def check_images(self, user: str, sizes: list[int], where: str = "request") -> None:
        """A request's images: how many (``max_images_per_request``) and each one's bytes as sent
        (``max_image_bytes``); ``sizes`` lists them in order (0 for an image sent as pixel values)."""
        limits = self.limits(user)
        if len(sizes) > limits.max_images_per_request:
            raise QuotaExceededError(
                f"{where} has {len(sizes)} images; the quota max_images_per_request of user {user!r} is "
                f"{limits.max_images_per_request}",
                "max_images_per_request",
            )
        for index, size in enumerate(sizes):
            if size > limits.max_image_bytes:
                raise QuotaExceededError(
                    f"{where}: image {index} is {size} bytes; the quota max_image_bytes of user {user!r} is "
                    f"{limits.max_image_bytes} (send it smaller, e.g. resized or as JPEG)",
                    "max_image_bytes",
                )

    def check_rate(self, user: str) -> None:
        """Take one request from ``user``'s bucket, or raise RateLimitError saying when to retry."""
        rate = self.limits(user).requests_per_second
        capacity = max(1.0, rate)
        with self._lock:
            now = self._clock()
            tokens, last = self._buckets.get(user, (capacity, now))
            tokens = min(capacity, tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[user] = (tokens, now)
                retry_after = (1.0 - tokens) / rate
                raise RateLimitError(
                    f"user {user!r} exceeded the quota requests_per_second={rate:g} "
                    f"(burst {capacity:g}); retry in {retry_after:.3f} s"
                )
            self._buckets[user] = (tokens - 1.0, now)
