"""Token buckets, caller identities, the limit fields of ServerConfig, the retry hint."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvstore.api import LookupResult
from kvstore.client import NO_RETRY, AsyncClient
from kvstore.config import DEFAULT_TENANT_RATE_BURST, DEFAULT_TENANT_RATE_RPS, ServerConfig
from kvstore.errors import ConfigError, RateLimited
from kvstore.keys import Namespace
from kvstore.rpc.status import error_from_status, error_metadata, status_for
from kvstore.server.daemon import serve
from kvstore.server.limits import RateLimiter, TokenBucket, peer_host
from kvstore.spec import KVSpec

from .helpers import small_config

NS = Namespace(model_id="m", spec=KVSpec(num_layers=1, num_kv_heads=1, head_dim=16,
                                         block_tokens=16), tenant="acme")


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
    ("rate_limit_rps", -2.0), ("rate_limit_rps", -0.5), ("rate_limit_rps", float("inf")),
    ("rate_limit_burst", -1),
])
def test_limit_fields_are_validated(field, bad):
    with pytest.raises(ConfigError, match=f"server.{field}"):
        dataclasses.replace(ServerConfig(), **{field: bad})


def test_limit_defaults():
    server = ServerConfig()
    assert server.max_request_tokens == 1_048_576 and server.stream_idle_timeout_s == 10.0
    assert server.rate_limit == (0, 0)  # one tenant (or none): off unless configured


TWO = {"acme": "tok-acme", "zeta": "tok-zeta"}


@pytest.mark.parametrize("fields, limit", [
    ({}, (0, 0)),
    ({"tenant_tokens": {"acme": "tok-acme"}}, (0, 0)),
    ({"tenant_tokens": TWO}, (DEFAULT_TENANT_RATE_RPS, DEFAULT_TENANT_RATE_BURST)),
    ({"tenant_tokens": TWO, "rate_limit_burst": 5}, (DEFAULT_TENANT_RATE_RPS, 5)),
    ({"tenant_tokens": TWO, "rate_limit_rps": 0.0}, (0, 0)),  # off, as the operator said
    ({"tenant_tokens": TWO, "rate_limit_rps": 50.0}, (50.0, 0)),  # an explicit rate wins
    ({"rate_limit_rps": 50.0, "rate_limit_burst": 7}, (50.0, 7)),
])
def test_the_rate_limit_is_on_by_default_with_several_tenants(fields, limit):
    assert ServerConfig(**fields).rate_limit == limit


async def _refused_of(root, calls: int, **server) -> int:
    """Lookups (of ``calls`` sent at once by tenant acme on its call channel) refused."""
    d = await serve(small_config(root, **server))
    try:
        async with AsyncClient(d.unix_address, token="tok-acme", retry=NO_RETRY) as client:
            await client.health()
            results = await asyncio.gather(*(client.lookup(NS, list(range(16)))
                                             for _ in range(calls)), return_exceptions=True)
        assert all(isinstance(r, (LookupResult, RateLimited)) for r in results), results
        return sum(isinstance(r, RateLimited) for r in results)
    finally:
        await d.stop(1.0)


async def test_a_daemon_of_several_tenants_limits_calls_unless_told_not_to(root):
    """Regression: with several tenants and no rate set, one tenant's flood of calls was never
    limited (the limit was off unless configured). A burst of 1 makes the default rate show
    at once: 64 calls arrive together, far faster than 4,000/s refills."""
    assert await _refused_of(root, 64, tenant_tokens=TWO, rate_limit_burst=1) > 0
    assert await _refused_of(root, 64, tenant_tokens=TWO, rate_limit_rps=0.0,
                             rate_limit_burst=1) == 0
    assert await _refused_of(root, 64, tenant_tokens={"acme": "tok-acme"},
                             rate_limit_burst=1) == 0

