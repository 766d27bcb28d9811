"""The store over a chain that ends in a shared tier (real Redis): lookups probe it past the
local match, gets bring its blocks in verified, demotion fills it instead of dropping, new
blocks are written through, and the directory says what other hosts hold."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.config import DramConfig, KVStoreConfig, RemoteConfig, TierConfig
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from kvstore.store import Store

from ..conftest import random_kv, random_tokens

MiB = 1 << 20
SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=16)  # 64 KiB blocks
NS = Namespace(model_id="m", spec=SPEC, tenant="acme")


def host(url: str, prefix: str, name: str, dram_bytes: int = 4 * MiB, **remote) -> KVStoreConfig:
    """One host's chain: its own DRAM, then the shared tier."""
    settings = {"url": url, "key_prefix": prefix, "host_id": name, "directory_flush_s": 0.05,
                **remote}
    return KVStoreConfig(tiers=(
        TierConfig("dram", "dram", DramConfig(capacity_bytes=dram_bytes, chunk_bytes=MiB,
                                              high_watermark=1.0, low_watermark=1.0)),
        TierConfig("remote", "remote", RemoteConfig(**settings))))


@pytest.fixture(params=["standalone", "cluster"])
def url(request) -> str:
    return request.getfixturevalue("redis_url" if request.param == "standalone"
                                   else "redis_cluster_url")


async def test_a_prefix_one_host_wrote_through_is_found_and_served_by_another(url, key_prefix):
    tokens, kv = random_tokens(16 * 12, seed=1), random_kv(SPEC, 16 * 12, seed=1)
    async with Store(host(url, key_prefix, "a", write_through=True)) as a, \
            Store(host(url, key_prefix, "b")) as b:
        assert await a.put(NS, tokens[:16 * 8], kv[:, :, :16 * 8]) == 128
        for _ in range(100):  # write-through runs in the background
            if a.stats().tiers["remote"].num_blocks == 8:
                break
            await asyncio.sleep(0.02)
        hit = await b.lookup(NS, tokens)
        assert hit.matched_tokens == 128 and hit.tokens_per_tier == {"remote": 128}
        got = await b.get(NS, tokens)
        assert torch.equal(got, kv[:, :, :128])
        assert (await b.lookup(NS, tokens)).tokens_per_tier == {"dram": 128}  # brought in
        assert b.stats().counters.promotions == 8
        other = Namespace(model_id="m", spec=SPEC, tenant="globex")
        assert (await b.lookup(other, tokens)).matched_tokens == 0
        assert await b.get(other, tokens) is None


async def test_lookup_reports_what_other_hosts_hold_locally(url, key_prefix):
    """With ``write_through = false`` (the switch that turns sharing by default off) the
    blocks stay local: the other host learns only from the directory that host a holds them,
    and matches nothing."""
    tokens, kv = random_tokens(16 * 6, seed=2), random_kv(SPEC, 16 * 6, seed=2)
    async with Store(host(url, key_prefix, "a", write_through=False)) as a, \
            Store(host(url, key_prefix, "b", write_through=False)) as b:
        await a.put(NS, tokens, kv)
        for _ in range(100):
            hit = await b.lookup(NS, tokens)
            if hit.cluster_tokens == {"a": 96}:  # a cluster applies a flush node by node
                break
            await asyncio.sleep(0.02)
        assert hit.matched_tokens == 0 and hit.cluster_tokens == {"a": 96}
        assert (await a.lookup(NS, tokens)).cluster_tokens == {}  # its own blocks are local
        assert a.stats().tiers["remote"].num_blocks == 0


async def test_demotion_fills_the_shared_tier_instead_of_dropping(redis_url, key_prefix):
    """A 1 MiB DRAM tier holds 15 blocks; 40 more go down into the shared tier, none dropped;
    every block reads back bit-exact."""
    prompts = [(random_tokens(16 * 10, seed=i), random_kv(SPEC, 16 * 10, seed=i))
               for i in range(4)]
    config = host(redis_url, key_prefix, "a", dram_bytes=MiB, write_through=False)
    async with Store(config) as store:
        for tokens, kv in prompts:
            assert await store.put(NS, tokens, kv) == 160
        stats = store.stats()
        assert stats.counters.dropped == 0 and stats.tiers["remote"].num_blocks >= 25
        for tokens, kv in prompts:
            assert torch.equal(await store.get(NS, tokens), kv)


async def test_demotion_into_the_shared_tier_respects_its_admission(redis_url, key_prefix):
    config = host(redis_url, key_prefix, "a", dram_bytes=MiB, admit_after_accesses=3,
                  write_through=False)  # write-through copies every new block, unfiltered
    async with Store(config) as store:
        for i in range(3):
            await store.put(NS, random_tokens(16 * 10, seed=i), random_kv(SPEC, 16 * 10, seed=i))
        stats = store.stats()
        assert stats.tiers["remote"].num_blocks == 0 and stats.counters.dropped == 15
