"""Each tier's eviction order comes from its settings (``eviction``); unknown names are refused."""

from __future__ import annotations

import pytest

from kvstore.config import DramConfig, KVStoreConfig, TierConfig, load_config
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.policy import ArcOrder, LruOrder, ValueOrder, build_order
from kvstore.store import Store

MiB = 1 << 20


def dram(eviction: str) -> DramConfig:
    return DramConfig(capacity_bytes=MiB, chunk_bytes=MiB, eviction=eviction)


def test_each_tier_gets_the_order_its_settings_name():
    config = KVStoreConfig(tiers=(TierConfig("hot", "dram", dram("value")),
                                  TierConfig("warm", "dram", dram("arc")),
                                  TierConfig("cold", "dram", dram("lru"))))
    store = Store(config)
    orders = store._dir._orders
    assert isinstance(orders["hot"], ValueOrder)
    assert isinstance(orders["warm"], ArcOrder)
    assert isinstance(orders["cold"], LruOrder)


def test_the_default_is_lru_and_names_are_validated():
    assert KVStoreConfig().dram.eviction == "lru"
    assert load_config(environ={"KVSTORE_DRAM__EVICTION": "arc"}).dram.eviction == "arc"
    with pytest.raises(ConfigError, match="dram.eviction"):
        load_config(environ={"KVSTORE_DRAM__EVICTION": "fifo"})
    with pytest.raises(InvalidArgument):
        build_order("fifo")
    with pytest.raises(InvalidArgument):
        build_order("value")  # without what a hit saves


@pytest.mark.parametrize("eviction", ["arc", "value"])
async def test_a_store_makes_room_with_the_order_it_was_given(eviction):
    """Two DRAM tiers of 15 blocks, 50 blocks written: every prefix stays readable from the top
    of its chain, whichever order chose the victims."""
    from kvstore.keys import Namespace
    from kvstore.spec import KVSpec

    from ..conftest import random_kv, random_tokens

    spec = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=16)
    ns = Namespace(model_id="m", spec=spec)
    settings = DramConfig(capacity_bytes=MiB, chunk_bytes=MiB, high_watermark=1.0,
                          low_watermark=1.0, eviction=eviction)
    config = KVStoreConfig(tiers=(TierConfig("hot", "dram", settings),
                                  TierConfig("warm", "dram", settings)))
    async with Store(config) as store:
        prompts = [random_tokens(16 * 10, seed=i) for i in range(5)]
        for i, tokens in enumerate(prompts):
            assert await store.put(ns, tokens, random_kv(spec, 16 * 10, seed=i)) == 160
        stats = store.stats()
        assert stats.tiers["hot"].num_blocks == 15 and stats.counters.demotions > 0
        matched = [(await store.lookup(ns, tokens)).matched_tokens for tokens in prompts]
        assert matched[-1] == 160 and sum(matched) == 16 * 30  # what fits, as whole prefixes
