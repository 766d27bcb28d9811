"""Sharing by default (kvstore.store.write_through), on real Redis servers: two hosts, each with
its own DRAM and SSD, configured with nothing but the shared tier's url, share what either
stores; the background queue drops and counts rather than stall; a dead or hung store never
holds a put back; closing drains what is queued."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from kvstore.config import (
    DramConfig,
    KVStoreConfig,
    RemoteConfig,
    SsdConfig,
    TierConfig,
    load_config,
    parse_assignments,
)
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from kvstore.store import Store

from ..conftest import random_kv, random_tokens
from ..redis_servers import RedisServer, free_port, needs_redis_binary

MiB = 1 << 20
SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=16)  # 64 KiB blocks
NS = Namespace(model_id="m", spec=SPEC, tenant="acme")
# What every offered block ends as, exactly once.
OUTCOMES = ("written", "failed", "skipped", "dropped_full")


def host(root: Path, url: str, key_prefix: str, **remote) -> KVStoreConfig:
    """One host's default chain (its own DRAM and SSD, then the shared tier) whose shared tier
    is given only its url (the key prefix keeps tests apart on one server)."""
    return KVStoreConfig(
        dram=DramConfig(capacity_bytes=16 * MiB, chunk_bytes=MiB),
        ssd=SsdConfig(path=str(root / "ssd"), capacity_bytes=64 * MiB, segment_bytes=MiB,
                      fsync="never"),
        remote=RemoteConfig(url=url, key_prefix=key_prefix, **remote))


async def until(check: Callable[[], Awaitable[object]], what: str, tries: int = 1000) -> object:
    """Poll ``check`` until it answers truthy (the background writer has caught up)."""
    for _ in range(tries):
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def write_through(store: Store) -> dict[str, float]:
    extra = store.stats().tiers["remote"].extra
    return {k.removeprefix("write_through_"): v for k, v in extra.items()
            if k.startswith("write_through_")}


async def drained(store: Store) -> dict[str, float]:
    async def check():
        counts = write_through(store)
        return counts if counts["queue_blocks"] == 0 else None

    return await until(check, "the write-through queue empties")


@pytest.fixture(params=["standalone", "cluster"])
def url(request) -> str:
    return request.getfixturevalue("redis_url" if request.param == "standalone"
                                   else "redis_cluster_url")


def test_the_shared_tier_writes_through_unless_turned_off():
    assert RemoteConfig().write_through is True
    off = load_config(None, environ={},
                      overrides=parse_assignments(["remote.write_through=false"]))  # --set
    assert off.remote.write_through is False
    assert DramConfig().write_through is False and SsdConfig().write_through is False


async def test_two_hosts_with_only_the_url_share_what_one_stores(url, key_prefix, tmp_path):
    """The issue's scenario: host b matched 0 tokens of a prefix host a stored (pages reached
    the shared store only by demotion off the bottom of a's SSD)."""
    n = 16 * 12
    tokens, kv = random_tokens(n, seed=1), random_kv(SPEC, n, seed=1)
    async with Store(host(tmp_path / "a", url, key_prefix)) as a, \
            Store(host(tmp_path / "b", url, key_prefix)) as b:
        assert await a.put(NS, tokens, kv) == n

        async def b_matches():
            hit = await b.lookup(NS, tokens)
            return hit if hit.matched_tokens == n else None

        hit = await until(b_matches, "host b matches the whole prefix")
        assert hit.tokens_per_tier == {"remote": n}
        assert torch.equal(await b.get(NS, tokens), kv)
        counts = await drained(a)
        assert counts["queued"] == counts["written"] == 12 and counts["dropped_full"] == 0
        assert a.stats().tiers["remote"].num_blocks == 12


async def test_without_write_through_the_other_host_matches_nothing(redis_url, key_prefix,
                                                                    tmp_path):
    """``remote.write_through = false``: a's blocks stay local (they would reach the shared
    store only by demotion), so b matches nothing though the directory says a holds them."""
    n = 16 * 6
    tokens, kv = random_tokens(n, seed=2), random_kv(SPEC, n, seed=2)
    async with Store(host(tmp_path / "a", redis_url, key_prefix, write_through=False,
                          host_id="a", directory_flush_s=0.05)) as a, \
            Store(host(tmp_path / "b", redis_url, key_prefix, write_through=False,
                       host_id="b")) as b:
        assert await a.put(NS, tokens, kv) == n

        async def directory_knows():
            hit = await b.lookup(NS, tokens)
            return hit if hit.cluster_tokens == {"a": n} else None

        hit = await until(directory_knows, "the directory says host a holds the prefix")
        assert hit.matched_tokens == 0 and await b.get(NS, tokens) is None
        assert a.stats().tiers["remote"].num_blocks == 0 and write_through(a) == {}


@pytest.mark.parametrize("bound", [{"write_through_queue_blocks": 3},
                                   {"write_through_queue_bytes": 1}])
async def test_a_full_queue_drops_and_counts_instead_of_stalling(redis_url, key_prefix,
                                                                  tmp_path, bound):
    """A queue of 3 blocks (or of 1 byte: one block at a time) against puts of 8 blocks: every
    put returns, the blocks past the bound are dropped and counted, each offered block is
    counted exactly once, and the dropped ones still serve locally."""
    prompts = [(random_tokens(16 * 8, seed=10 + i), random_kv(SPEC, 16 * 8, seed=10 + i))
               for i in range(12)]
    async with Store(host(tmp_path / "a", redis_url, key_prefix, **bound)) as a:
        for tokens, kv in prompts:
            assert await a.put(NS, tokens, kv) == 128
            assert write_through(a)["queue_blocks"] <= 3
        counts = await drained(a)
        assert counts["dropped_full"] > 0 and counts["written"] > 0
        assert sum(counts[k] for k in OUTCOMES) == 8 * len(prompts)
        assert counts["written"] == a.stats().tiers["remote"].num_blocks
        for tokens, _ in prompts:
            assert (await a.lookup(NS, tokens)).matched_tokens == 128


async def test_a_store_on_a_closed_port_never_holds_a_put_back(key_prefix, tmp_path):
    dead = f"redis://127.0.0.1:{free_port()}"
    async with Store(host(tmp_path / "a", dead, key_prefix)) as a:
        for i in range(20):
            tokens, kv = random_tokens(16 * 4, seed=30 + i), random_kv(SPEC, 16 * 4, seed=30 + i)
            assert await asyncio.wait_for(a.put(NS, tokens, kv), timeout=60) == 64
        counts = await drained(a)
        assert counts["written"] == 0 and counts["failed"] > 0
        assert sum(counts[k] for k in OUTCOMES) == 80


@needs_redis_binary
async def test_a_hung_store_never_holds_a_put_back(key_prefix, tmp_path):
    """A redis-server stopped with SIGSTOP accepts connections and never answers: puts all
    return while the writer waits on it, the queue stays within its bound and drops the rest;
    once the server answers again, the queue drains into it."""
    server = RedisServer(tmp_path / "redis").start()
    config = host(tmp_path / "a", server.url, key_prefix, write_through_queue_blocks=8)
    try:
        async with Store(config) as a:
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                for i in range(20):
                    tokens = random_tokens(16 * 4, seed=50 + i)
                    kv = random_kv(SPEC, 16 * 4, seed=50 + i)
                    assert await asyncio.wait_for(a.put(NS, tokens, kv), timeout=60) == 64
                    assert write_through(a)["queue_blocks"] <= 8
                assert write_through(a)["dropped_full"] > 0
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            counts = await drained(a)
            assert sum(counts[k] for k in OUTCOMES) == 80
            for seed in range(100, 1000):  # a fresh block each time, until the breaker closes
                tokens, kv = random_tokens(16, seed=seed), random_kv(SPEC, 16, seed=seed)
                assert await a.put(NS, tokens, kv) == 16
                if (await drained(a))["written"] > counts["written"]:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("writes never reached the store once it answered again")
    finally:
        server.kill()


async def test_closing_drains_the_queue_into_the_shared_tier(redis_url, key_prefix, tmp_path):
    """Host a stores and closes at once: what it queued is written before it goes, so host b,
    started afterwards, serves all of it."""
    n = 16 * 16
    tokens, kv = random_tokens(n, seed=3), random_kv(SPEC, n, seed=3)
    async with Store(host(tmp_path / "a", redis_url, key_prefix)) as a:
        assert await a.put(NS, tokens, kv) == n
    async with Store(host(tmp_path / "b", redis_url, key_prefix)) as b:
        assert (await b.lookup(NS, tokens)).matched_tokens == n
        assert torch.equal(await b.get(NS, tokens), kv)


async def test_the_shared_byte_budget_holds(redis_url, key_prefix, tmp_path):
    """A 1 MiB budget in the shared store (16 pages): 40 blocks written through keep within it,
    the oldest pages making room for the newest."""
    async with Store(host(tmp_path / "a", redis_url, key_prefix,
                          capacity_bytes=MiB)) as a:
        for i in range(5):
            tokens, kv = random_tokens(16 * 8, seed=70 + i), random_kv(SPEC, 16 * 8, seed=70 + i)
            assert await a.put(NS, tokens, kv) == 128
            await drained(a)
            remote = a.stats().tiers["remote"]
            assert remote.used_bytes <= MiB
        assert remote.num_blocks > 0 and write_through(a)["written"] >= 8


async def test_blocks_the_shared_tier_holds_already_are_skipped(redis_url, key_prefix):
    """A 1 MiB DRAM tier in front of the shared tier: a 40-block put fills DRAM with the 15 it
    pins, and the rest go straight into the shared tier; the queue skips those instead of
    sending them again, and copies the 15 (each block counted once)."""
    config = KVStoreConfig(tiers=(
        TierConfig("dram", "dram", DramConfig(capacity_bytes=MiB, chunk_bytes=MiB,
                                              high_watermark=1.0, low_watermark=1.0)),
        TierConfig("remote", "remote", RemoteConfig(url=redis_url, key_prefix=key_prefix))))
    n = 16 * 40
    tokens, kv = random_tokens(n, seed=4), random_kv(SPEC, n, seed=4)
    async with Store(config) as store:
        assert await store.put(NS, tokens, kv) == n
        counts = await drained(store)
        assert counts["skipped"] >= 25 and counts["written"] + counts["skipped"] == 40
        assert store.stats().tiers["remote"].num_blocks == 40
        assert torch.equal(await store.get(NS, tokens), kv)
