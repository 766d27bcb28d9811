"""The value policy's writes along the chain: a put's copy of a block held only further down
goes up (``AdmissionPolicy.lifts``), and a copy leaving a tier moves down one tier even when a
slower tier holds another."""

from __future__ import annotations

import torch

from kvstore.config import KVStoreConfig, TierConfig
from kvstore.store import Store

from ..conftest import random_kv, random_tokens
from .test_chain import MiB, dram, namespace, ssd


def chain(tmp_path, eviction: str, warm_bytes: int = MiB) -> KVStoreConfig:
    return KVStoreConfig(tiers=(TierConfig("hot", "dram", dram(eviction=eviction)),
                                TierConfig("warm", "dram", dram(warm_bytes, eviction=eviction)),
                                TierConfig("cold", "ssd", ssd(tmp_path, eviction=eviction))))


def prompts(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from .test_chain import SPEC
    return [(random_tokens(16 * 10, seed=i), random_kv(SPEC, 16 * 10, seed=i)) for i in range(n)]


async def test_a_put_lifts_blocks_held_only_further_down_under_the_value_order(tmp_path):
    """Regression (``kvstore bench policy``, doc-qa and chat): a prefix only the SSD held was
    recomputed at every use, since fetching it was slower than prefill; its put wrote nothing,
    so it was never promoted. Under the LRU order a put still writes only new blocks."""
    ns = namespace()
    for eviction, lifted in (("value", True), ("lru", False)):
        async with Store(chain(tmp_path / eviction, eviction)) as store:
            batch = prompts(5)  # 50 blocks: the first prompt ends up on the SSD
            for tokens, kv in batch:
                await store.put(ns, tokens, kv)
            tokens, kv = batch[0]
            before = (await store.lookup(ns, tokens)).tokens_per_tier
            assert "cold" in before, eviction
            assert await store.put(ns, tokens, kv) == 0  # nothing new to write
            after = (await store.lookup(ns, tokens)).tokens_per_tier
            if lifted:
                assert after == {"hot": 160}
                assert store.stats().counters.promotions >= before["cold"] // 16
            else:
                assert after == before
            assert torch.equal(await store.get(ns, tokens), kv)


async def test_a_copy_leaving_a_tier_moves_down_one_tier_past_a_slower_copy(tmp_path):
    """Regression: a block evicted from the first tier while the SSD held another copy was
    dropped there, so it came back from the SSD (or was recomputed) instead of DRAM."""
    ns = namespace()
    async with Store(chain(tmp_path, "value", warm_bytes=2 * MiB)) as store:
        batch = prompts(6)
        for tokens, kv in batch[:5]:  # 50 blocks: 45 fit in "hot" and "warm"
            await store.put(ns, tokens, kv)
        tokens, kv = batch[0]
        assert "cold" in (await store.lookup(ns, tokens)).tokens_per_tier
        await store.put(ns, tokens, kv)  # lifted into "hot"; "cold" keeps its copies
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"hot": 160}
        for other, _ in batch[1:5]:  # room in "warm" (and "cold"): nothing else competes
            await store.evict(keys=(await store.lookup(ns, other)).keys)
        await store.put(ns, *batch[5])  # 10 new blocks push the prompt out of "hot"
        tiers = (await store.lookup(ns, tokens)).tokens_per_tier
        assert tiers.get("warm", 0) + tiers.get("hot", 0) == 160, tiers
        assert torch.equal(await store.get(ns, tokens), kv)
