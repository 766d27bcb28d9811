"""A put's count is what a lookup matches right after, with DRAM full and the SSD's frequency
filter on; background demotion moves blocks down and never drops them (issue 28)."""

from __future__ import annotations

import pytest

from kvstore.config import DramConfig, KVStoreConfig, SsdConfig, TierConfig
from kvstore.store import Store

from ..conftest import random_kv, random_tokens
from .test_chain import SPEC, MiB, namespace


def filtered_chain(tmp_path) -> KVStoreConfig:
    """4 MiB of DRAM (60 blocks) with the daemon's watermarks over an SSD whose filter wants
    two sightings, as by default."""
    return KVStoreConfig(tiers=(
        TierConfig("dram", "dram", DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB,
                                              high_watermark=0.95, low_watermark=0.85)),
        TierConfig("ssd", "ssd", SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=64 * MiB,
                                           segment_bytes=MiB, fsync="never",
                                           admit_after_accesses=2))))


async def _fill(store: Store, num_prompts: int, seed: int) -> None:
    """One-off prompts of 10 blocks each: seen once, so the filter keeps them off the SSD."""
    for i in range(num_prompts):
        tokens = random_tokens(160, seed=seed + i)
        assert await store.put(namespace(), tokens, random_kv(SPEC, 160, seed=seed + i)) == 160


@pytest.mark.parametrize("num_blocks", [59, 80])
async def test_a_put_into_full_dram_reports_what_a_lookup_matches(tmp_path, num_blocks):
    """Regression: the put replaced DRAM's one-off blocks with its own (59: all but one of
    DRAM; 80: DRAM's worth, the rest written to the SSD as new blocks), pushing DRAM above its
    high watermark, and the demotion that woke dropped the put's tail from DRAM (seen once,
    so refused by the filter): 944 and 1280 tokens reported, 816 matched. Now they stay."""
    ns = namespace()
    async with Store(filtered_chain(tmp_path)) as store:
        await _fill(store, 6, seed=10)
        tokens = random_tokens(16 * num_blocks, seed=1)
        written = await store.put(ns, tokens, random_kv(SPEC, 16 * num_blocks, seed=1))
        assert written == 16 * num_blocks
        await store._demoter.settle()  # the demotion the put woke, done
        assert (await store.lookup(ns, tokens)).matched_tokens == written


async def test_demotion_above_the_watermark_moves_only_what_the_filter_admits(tmp_path):
    """The background pass still demotes blocks seen twice (a put and a hit) to the SSD, down
    to the low watermark; one-off blocks stay in DRAM until a write needs their room (a drop
    frees room at once: dropping them ahead of need only loses hits)."""
    ns = namespace()
    async with Store(filtered_chain(tmp_path)) as store:
        seen = random_tokens(160, seed=40)
        await store.put(ns, seen, random_kv(SPEC, 160, seed=40))  # the coldest 10 blocks
        assert (await store.lookup(ns, seen)).matched_tokens == 160
        await _fill(store, 5, seed=10)  # 50 one-offs
        dram = store.tiers["dram"]
        assert dram.used_bytes > 0.95 * dram.capacity_bytes  # 60 blocks
        await store._demoter.settle()
        assert dram.used_bytes <= 0.85 * dram.capacity_bytes
        assert store.stats().tiers["ssd"].num_blocks >= 9  # the seen prompt's, coldest first
        await _fill(store, 1, seed=15)  # room for it: the rest of the seen prompt moves down
        # Now the one-offs are the coldest: a pass moves none of them, and drops none.
        await store._demoter.settle()
        assert store.stats().tiers["ssd"].num_blocks == 10
        assert store.stats().counters.dropped == 0
        # (Counted, not looked up: a lookup's hit is a sighting that would admit them.)
        assert store.stats().tiers["dram"].num_blocks == 60
        # A write that needs room takes theirs (the filter refuses them, seen once: dropped).
        await _fill(store, 1, seed=30)
        assert store.stats().counters.dropped == 10
        assert (await store.lookup(ns, seen)).tokens_per_tier == {"ssd": 160}
