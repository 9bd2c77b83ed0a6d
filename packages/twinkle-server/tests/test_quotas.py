import threading

import pytest

from twinkle.errors import QuotaExceededError, RateLimitError
from twinkle.server.config import Quotas, ServerConfig, UserConfig
from twinkle.server.quotas import QuotaChecker


@pytest.fixture
def config():
    return ServerConfig(
        quotas=Quotas(max_adapters=2, max_rank=16, max_tokens_per_request=1000, requests_per_second=2.0),
        users={"vip": UserConfig(quotas={"max_adapters": 5, "max_rank": 64, "requests_per_second": 0.5})},
    )


def test_per_user_overrides_apply_on_top_of_defaults(config):
    checker = QuotaChecker(config)
    assert checker.limits("alice") == Quotas(2, 16, 1000, 2.0)
    assert checker.limits("vip") == Quotas(5, 64, 1000, 0.5)


def test_adapter_quota_names_limit_and_numbers(config):
    checker = QuotaChecker(config)
    checker.check_new_adapter("alice", current_count=1, rank=16)
    with pytest.raises(
        QuotaExceededError, match=r"user 'alice' already has 2 adapter\(s\) loaded; quota max_adapters is 2"
    ) as info:
        checker.check_new_adapter("alice", current_count=2, rank=8)
    assert info.value.limit == "max_adapters"
    checker.check_new_adapter("vip", current_count=4, rank=64)


def test_rank_quota(config):
    checker = QuotaChecker(config)
    with pytest.raises(QuotaExceededError, match="LoRA rank 32 exceeds the quota max_rank 16 of user 'alice'") as info:
        checker.check_new_adapter("alice", current_count=0, rank=32)
    assert info.value.limit == "max_rank" and not isinstance(info.value, RateLimitError)


def test_token_quota(config):
    checker = QuotaChecker(config)
    checker.check_tokens("alice", 1000)
    with pytest.raises(
        QuotaExceededError, match="request has 1001 tokens; the quota max_tokens_per_request of user 'alice' is 1000"
    ) as info:
        checker.check_tokens("alice", 1001)
    assert info.value.limit == "max_tokens_per_request"


def test_token_bucket_bursts_then_refills(config, clock):
    checker = QuotaChecker(config, clock=clock)
    checker.check_rate("alice")
    checker.check_rate("alice")  # burst of one second's worth: 2 requests
    with pytest.raises(
        RateLimitError, match=r"user 'alice' exceeded the quota requests_per_second=2 \(burst 2\); retry in 0.500 s"
    ) as info:
        checker.check_rate("alice")
    assert info.value.limit == "requests_per_second"
    checker.check_rate("bob")  # buckets are per user
    clock.now += 0.25
    with pytest.raises(RateLimitError, match=r"retry in 0\.250 s"):
        checker.check_rate("alice")
    clock.now += 0.25
    checker.check_rate("alice")  # one token refilled after 0.5 s at 2/s
    clock.now += 60
    checker.check_rate("alice")
    checker.check_rate("alice")  # refill is capped at the burst size
    with pytest.raises(RateLimitError):
        checker.check_rate("alice")


def test_slow_rate_still_allows_one_request(config, clock):
    checker = QuotaChecker(config, clock=clock)
    checker.check_rate("vip")  # 0.5/s: bucket holds at least one request
    with pytest.raises(RateLimitError, match=r"requests_per_second=0.5 \(burst 1\); retry in 2.000 s"):
        checker.check_rate("vip")
    clock.now += 2
    checker.check_rate("vip")


def test_rate_limit_is_thread_safe(config, clock):
    checker = QuotaChecker(config, clock=clock)
    allowed = []

    def hammer() -> None:
        for _ in range(50):
            try:
                checker.check_rate("alice")
                allowed.append(1)
            except RateLimitError:
                pass

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(allowed) == 2  # the clock never moved: exactly the burst gets through


def test_sampling_counts_every_prompt_and_what_each_sample_may_generate(config):
    checker = QuotaChecker(config)
    checker.check_sampling("alice", prompt_tokens=100, n_prompts=2, max_tokens=150, num_samples=2)  # 800
    with pytest.raises(QuotaExceededError, match="request has 1002 tokens") as info:
        checker.check_sampling("alice", prompt_tokens=1, n_prompts=1, max_tokens=500, num_samples=2)
    assert info.value.limit == "max_tokens_per_request"
