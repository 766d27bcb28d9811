"""Token buckets, caller identities, the limit fields of ServerConfig, the retry hint."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.config import ServerConfig
from kvstore.errors import ConfigError, RateLimited
from kvstore.rpc.status import error_from_status, error_metadata, status_for
from kvstore.server.limits import RateLimiter, TokenBucket, peer_host


def test_bucket_allows_a_burst_then_the_rate():
    bucket = TokenBucket(rate_per_s=10.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.1)  # one call refills in 1/rate
    assert bucket.take(0.1) == 0.0
    assert bucket.take(0.1) > 0
    assert not bucket.is_full(0.1) and bucket.is_full(10.0)
    assert [bucket.take(10.0) for _ in range(4)][-1] > 0  # refills to the burst, not beyond


def test_limiter_keeps_callers_apart_and_says_when_to_retry():
    limiter = RateLimiter(rate_per_s=2.0, burst=0)
    assert limiter.burst == 2  # 0: one second's worth
    limiter.check("tenant acme")
    limiter.check("tenant acme")
    with pytest.raises(RateLimited, match=r"2 calls/s .*'tenant acme'.* retry in 0\.\d+ s") as info:
        limiter.check("tenant acme")
    assert 0 < info.value.retry_after_s <= 0.5
    limiter.check("tenant zeta")  # another caller has its own bucket
    with pytest.raises(ValueError):
        RateLimiter(rate_per_s=0, burst=1)


def test_limiter_drops_refilled_buckets_when_the_table_is_large():
    limiter = RateLimiter(rate_per_s=1e6, burst=1)
    for i in range(RateLimiter._PRUNE_AT + 10):
        limiter.check(f"peer ipv4:10.0.{i >> 8}.{i & 255}")
    assert len(limiter._buckets) <= RateLimiter._PRUNE_AT


def test_retry_hint_survives_the_wire():
    exc = RateLimited("slow down", retry_after_s=0.25)
    back = error_from_status(status_for(exc), str(exc), error_metadata(exc))
    assert type(back) is RateLimited and back.retry_after_s == 0.25
    assert status_for(exc).name == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize("peer, host", [
    ("ipv4:127.0.0.1:5000", "ipv4:127.0.0.1"),
    ("ipv6:[::1]:5000", "ipv6:[::1]"),
    ("unix:/run/kvstore/kvstore.sock", "unix:"),
    ("unix:", "unix:"),
    ("weird", "weird"),
])
def test_peer_host_drops_the_port(peer, host):
    assert peer_host(peer) == host


@pytest.mark.parametrize("field, bad", [
    ("stream_idle_timeout_s", 0.0), ("stream_idle_timeout_s", float("nan")),
    ("stream_idle_timeout_s", 1e9), ("max_request_tokens", 0), ("max_connections", 0),
    ("max_streams_per_connection", 0), ("max_concurrent_rpcs", 1 << 31),
    ("rate_limit_rps", -1.0), ("rate_limit_rps", float("inf")), ("rate_limit_burst", -1),
])
def test_limit_fields_are_validated(field, bad):
    with pytest.raises(ConfigError, match=f"server.{field}"):
        dataclasses.replace(ServerConfig(), **{field: bad})


def test_limit_defaults():
    server = ServerConfig()
    assert server.max_request_tokens == 1_048_576 and server.stream_idle_timeout_s == 10.0
    assert server.rate_limit_rps == 0  # off unless configured

