"""The remote tier on real Redis servers (standalone and a 3-master cluster): batched probes and
reads, verification of pages other hosts wrote, tenant scoping, TTL and budget, faults as
misses within a bound, and the cluster directory."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import redis

from kvstore.config import RemoteConfig
from kvstore.errors import ConfigError
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, encode_page
from kvstore.tiers.remote.link import Breaker
from kvstore.tiers.remote.tier import RemoteTier

from ..redis_servers import RedisServer, free_port, needs_redis_binary

NS = b"n" * 16


def pages(n: int, tenant: str = "acme", payload_bytes: int = 20_000, ns: bytes = NS
          ) -> list[tuple[PageMeta, bytes]]:
    out = []
    for i in range(n):
        key = BlockKey(os.urandom(16))
        meta = PageMeta(key=key, namespace=ns, parent=None, block_index=i, tenant=tenant,
                        model_id="m", codec="raw", codec_id=1)
        out.append((meta, encode_page(meta, os.urandom(payload_bytes))))
    return out


@pytest.fixture(params=["standalone", "cluster"])
def url(request) -> str:
    return request.getfixturevalue("redis_url" if request.param == "standalone"
                                   else "redis_cluster_url")


@pytest.fixture
async def remote(url, key_prefix):
    tier = RemoteTier(RemoteConfig(url=url, key_prefix=key_prefix, directory=False))
    await tier.open()
    yield tier
    await tier.close()


def sync_client(url: str):
    client = redis.Redis.from_url(url)
    if client.info("cluster").get("cluster_enabled"):
        client.close()
        return redis.RedisCluster.from_url(url)
    return client


async def test_probe_counts_leading_pages_and_reads_verify(remote):
    stored = pages(12)
    assert all(await remote.write_many(stored[:10]))
    keys = [m.key for m, _ in stored]
    assert await remote.exists_prefix(keys, "acme") == 10
    assert await remote.exists_prefix(keys[1:], "acme") == 9
    read = await remote.read_many(keys[:10], "acme", NS)
    assert [bytes(p.data) for p in read] == [d for _, d in stored[:10]]
    assert (await remote.read_many(keys[10:], "acme", NS)) == [None, None]


async def test_pages_spread_over_every_cluster_node(redis_cluster_url, key_prefix):
    """No hot slot: the block key, not a hash tag, picks the slot."""
    tier = RemoteTier(RemoteConfig(url=redis_cluster_url, key_prefix=key_prefix,
                                   directory=False))
    await tier.open()
    try:
        assert all(await tier.write_many(pages(60, payload_bytes=1000)))
        client = sync_client(redis_cluster_url)
        per_node = [len(client.keys(f"{key_prefix}:*", target_nodes=node))
                    for node in client.get_primaries()]
        client.close()
        assert sum(per_node) == 60 and len(per_node) == 3 and min(per_node) >= 8
    finally:
        await tier.close()


async def test_a_tenant_never_sees_another_tenants_pages(remote):
    stored = pages(3, tenant="acme")
    await remote.write_many(stored)
    keys = [m.key for m, _ in stored]
    assert await remote.exists_prefix(keys, "globex") == 0
    assert await remote.read_many(keys, "globex", NS) == [None, None, None]
    assert all(remote.page_key(k, "acme") != remote.page_key(k, "globex") for k in keys)


async def test_a_corrupted_page_is_a_counted_miss_and_is_deleted(remote, url):
    """SETRANGE inside Redis flips payload bytes: the page is never served, counted corrupt,
    and deleted so no other host trips on it."""
    (meta, data), = pages(1)
    await remote.write_many([(meta, data)])
    client = sync_client(url)
    name = remote.page_key(meta.key, "acme")
    client.setrange(name, len(data) - 50, b"\xff" * 8)
    assert await remote.read_many([meta.key], "acme", NS) == [None]
    assert remote.stats().corrupt == 1 and client.exists(name) == 0
    client.close()


async def test_a_page_of_another_namespace_is_never_served(remote):
    (meta, data), = pages(1, ns=b"x" * 16)
    await remote.write_many([(meta, data)])
    assert await remote.read_many([meta.key], "acme", NS) == [None]
    assert remote.stats().corrupt == 1


async def test_a_truncated_page_is_never_served(remote, url):
    """What a put cut off half way would leave, if Redis applied commands in parts."""
    (meta, data), = pages(1)
    client = sync_client(url)
    client.set(remote.page_key(meta.key, "acme"), data[: len(data) // 2])
    assert await remote.read_many([meta.key], "acme", NS) == [None]
    assert remote.stats().corrupt == 1
    client.close()


async def test_ttl_expires_pages_and_gives_the_budget_back(url, key_prefix):
    tier = RemoteTier(RemoteConfig(url=url, key_prefix=key_prefix, ttl_s=0.3,
                                   capacity_bytes=100_000, directory=False))
    await tier.open()
    try:
        stored = pages(4)  # 4 x ~20 KB: the fifth would pass the budget
        assert all(await tier.write_many(stored))
        assert tier.room_for(30_000) is not None
        await asyncio.sleep(0.5)
        assert tier.used_bytes == 0 and tier.room_for(30_000) is None
        assert await tier.exists_prefix([m.key for m, _ in stored], "acme") == 0
    finally:
        await tier.close()


async def test_unreachable_store_answers_misses_within_the_bound():
    """Nothing listens on the port: open succeeds (local tiers keep serving), every call is a
    miss or a refused write well under a second, the breaker opens, health says why."""
    config = RemoteConfig(url=f"redis://127.0.0.1:{free_port()}", timeout_s=0.1, retries=1,
                          breaker_failures=2, directory=False)
    tier = RemoteTier(config)
    started = time.monotonic()
    await tier.open()
    stored = pages(2)
    assert await tier.exists_prefix([m.key for m, _ in stored], "acme") == 0
    assert await tier.write_many(stored) == [False, False]
    assert await tier.read_many([stored[0][0].key], "acme", NS) == [None]
    assert time.monotonic() - started < 1.5
    assert "breaker open" in tier.health() and tier.stats().extra["available"] == 0
    await tier.close()


@needs_redis_binary
async def test_wrong_password_is_a_clear_error_at_open(tmp_path):
    server = RedisServer(tmp_path, password="right").start()
    try:
        bad = server.url.replace(":right@", ":wrong@")
        tier = RemoteTier(RemoteConfig(url=bad, directory=False))
        with pytest.raises(ConfigError, match="refused the credentials") as caught:
            await tier.open()
        assert "wrong" not in str(caught.value) and "***" in str(caught.value)
        await tier.close()
        good = RemoteTier(RemoteConfig(url=server.url, directory=False))
        await good.open()
        assert await good.write_many(pages(1)) == [True]
        await good.close()
    finally:
        server.kill()


def test_breaker_opens_half_opens_and_closes():
    now = [0.0]
    breaker = Breaker(failures=2, reset_s=1.0, clock=lambda: now[0])
    breaker.failed()
    assert breaker.allows()
    breaker.failed()
    assert not breaker.allows() and breaker.is_open
    now[0] = 1.5
    assert breaker.allows() and not breaker.allows()  # one trial call at a time
    breaker.failed()
    assert not breaker.allows()
    now[0] = 3.0
    assert breaker.allows()
    breaker.succeeded()
    assert breaker.allows() and not breaker.is_open


def test_config_validates_and_hides_the_password():
    config = RemoteConfig(url="redis://app:s3cret@cache:6379/0")
    assert config.safe_url == "redis://app:***@cache:6379/0"
    assert RemoteConfig(url="rediss://cache:6380").safe_url == "rediss://cache:6380"
    with pytest.raises(ConfigError, match="remote.url"):
        RemoteConfig(url="http://cache:6379")
    with pytest.raises(ConfigError, match="remote.timeout_s"):
        RemoteConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="remote.mode"):
        RemoteConfig(mode="sentinel")


async def test_directory_shows_live_hosts_and_forgets_a_host_that_disappears(url, key_prefix):
    def config(host: str) -> RemoteConfig:
        return RemoteConfig(url=url, key_prefix=key_prefix, host_id=host, host_ttl_s=0.6,
                            directory_flush_s=0.05)

    a, b = RemoteTier(config("host-a")), RemoteTier(config("host-b"))
    await a.open()
    await b.open()
    try:
        stored = pages(3)
        for meta, _ in stored:
            a.note_local(meta, "dram", True)
        a.note_local(stored[2][0], "dram", False)
        keys = [m.key for m, _ in stored]
        for _ in range(50):
            held = await b.holders(keys, "acme")
            if held[:2] == [{"host-a": ("dram",)}] * 2:
                break
            await asyncio.sleep(0.05)
        assert held == [{"host-a": ("dram",)}, {"host-a": ("dram",)}, {}]
        assert await b.holders(keys, "globex") == [{}, {}, {}]
        listed = await b.cluster_entries("acme", 100)
        assert {(e.host, e.block_index) for e in listed} == {("host-a", 0), ("host-a", 1)}
        assert all(0 < e.expires_in_s <= 0.6 for e in listed)
        a._directory._task.cancel()  # host a stops renewing without withdrawing (a crash)
        await asyncio.sleep(0.8)
        assert await b.holders(keys, "acme") == [{}, {}, {}]
    finally:
        await a.close()
        await b.close()
