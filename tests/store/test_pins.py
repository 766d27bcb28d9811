"""TTL pins and invalidation in the embedded Store, over real DRAM and SSD tiers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat

import pytest

from kvstore.config import DramConfig, KVStoreConfig, QuotaConfig, SsdConfig
from kvstore.errors import CapacityError, InvalidArgument
from kvstore.keys import Namespace, block_keys
from kvstore.spec import KVSpec
from kvstore.store import Store

from ..conftest import random_kv, random_tokens

MiB = 1 << 20
# 32 KiB pages: a few hundred blocks fill the small tiers below.
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=128, block_tokens=16, dtype="bfloat16")
NS = Namespace(model_id="m", spec=SPEC, revision="r1", tenant="acme")


def config(tmp_path, pin_bytes=0) -> KVStoreConfig:
    return KVStoreConfig(
        dram=DramConfig(capacity_bytes=2 * MiB, chunk_bytes=1 * MiB),
        ssd=SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=4 * MiB, segment_bytes=1 * MiB,
                      admit_after_accesses=1, fsync="never"),
        quota=QuotaConfig(pin_bytes=pin_bytes),
    )


async def fill(store: Store, ns: Namespace, num_bytes: int, seed: int = 100) -> None:
    """Put other prefixes worth ``num_bytes`` of pages."""
    for i in range(num_bytes // (16 * 32 << 10)):
        await store.put(ns, random_tokens(256, seed=seed + i), random_kv(SPEC, 256, seed=i))


async def wait_for(predicate, timeout_s: float = 20.0) -> None:
    """Poll ``predicate`` until true (no timing is asserted: only that it happens)."""
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition never became true")


async def test_pinned_prefix_outlives_pressure_and_restart_then_expires(tmp_path):
    prompt = random_tokens(128, seed=1)
    async with Store(config(tmp_path)) as store:
        assert await store.put(NS, prompt, random_kv(SPEC, 128)) == 128
        pin = await store.pin(NS, prompt, ttl_s=3600)
        assert (pin.num_blocks, pin.tenant) == (8, "acme") and pin.size_bytes > 0
        unpinned = random_tokens(128, seed=2)
        await store.put(NS, unpinned, random_kv(SPEC, 128))
        await fill(store, NS, 12 * MiB)  # three times DRAM + SSD
        assert (await store.lookup(NS, prompt)).matched_tokens == 128
        assert (await store.lookup(NS, unpinned)).matched_tokens == 0  # ordinary: gone
    pins_file = tmp_path / "ssd" / "pins.json"
    assert stat.S_IMODE(os.stat(pins_file).st_mode) == 0o600
    assert len(json.loads(pins_file.read_text())["pins"]) == 1

    async with Store(config(tmp_path)) as store:
        assert [p.num_blocks for p in store.list_pins("acme")] == [8]
        await fill(store, NS, 12 * MiB, seed=500)
        assert (await store.lookup(NS, prompt)).matched_tokens == 128
        # A short pin replaces the long one; once it runs out the blocks are ordinary.
        await store.pin(NS, prompt, ttl_s=0.2)

        async def expired() -> bool:
            return not store.list_pins()

        await wait_for(expired)
        # Ordinary again: an ordinary evict, which leaves pinned blocks, takes them. (Not
        # pressure: whether a fill pushes them off the SSD depends on background demotion and
        # compaction keeping up, which a loaded box does not promise.)
        assert await store.evict(tenant="acme") > 0
        assert (await store.lookup(NS, prompt)).matched_tokens == 0


async def test_pin_over_budget_is_refused_with_the_numbers(tmp_path):
    async with Store(config(tmp_path, pin_bytes=200_000)) as store:
        first, second = random_tokens(64, seed=1), random_tokens(64, seed=2)
        await store.put(NS, first, random_kv(SPEC, 64))
        await store.put(NS, second, random_kv(SPEC, 64))
        pinned = (await store.pin(NS, first, 60)).size_bytes
        assert 0 < pinned <= 200_000
        with pytest.raises(CapacityError) as info:
            await store.pin(NS, second, 60)
        text = str(info.value)
        assert f"{pinned} bytes pinned" in text and "200000-byte pin budget" in text
        asked = int(text.split(" asks ")[1].split()[0])
        assert pinned + asked > 200_000
        assert [p.key for p in store.list_pins()] == [block_keys(NS, first)[-1]]
        # Pinning the same prefix again costs nothing more: only new blocks are charged.
        assert (await store.pin(NS, first, 120)).num_blocks == 4
        with pytest.raises(InvalidArgument, match="ttl_s"):
            await store.pin(NS, first, 0)


async def test_unpin_ends_pins_of_prefixes_and_blocks_stay_while_one_covers_them(tmp_path):
    async with Store(config(tmp_path)) as store:
        tokens = random_tokens(128, seed=3)
        await store.put(NS, tokens, random_kv(SPEC, 128))
        await store.pin(NS, tokens[:64], 60)
        await store.pin(NS, tokens, 60)
        assert await store.unpin(NS, tokens[:64]) == 1  # the longer pin still covers them
        await fill(store, NS, 12 * MiB)
        assert (await store.lookup(NS, tokens)).matched_tokens == 128
        other = dataclasses.replace(NS, tenant="zeta")
        assert await store.unpin(other, tokens) == 0  # another tenant's keys differ
        assert await store.unpin(NS, tokens) == 1
        assert store.list_pins() == []


async def test_evict_by_revision_drops_exactly_those_blocks(tmp_path):
    old, new = NS, dataclasses.replace(NS, revision="r2")
    lora = dataclasses.replace(NS, adapter_id="lora-a")
    tokens = random_tokens(64, seed=4)
    async with Store(config(tmp_path)) as store:
        for ns in (old, new, lora):
            await store.put(ns, tokens, random_kv(SPEC, 64))
        await store.pin(old, tokens, 3600)  # an invalidation removes pinned blocks too
        lease = await store.acquire(old, tokens)  # and hides leased ones at once
        assert await store.evict(revision="r1", adapter_id="") == 4
        assert (await store.lookup(old, tokens)).matched_tokens == 0
        assert await store.get(old, tokens) is None
        assert (await store.lookup(new, tokens)).matched_tokens == 64
        assert (await store.lookup(lora, tokens)).matched_tokens == 64
        assert store.list_pins() == []
        await store.release(lease.lease_id)

        async def deleted() -> bool:
            return store.stats().num_blocks == 8

        await wait_for(deleted)
    # After a restart the blocks carry only their namespace's fingerprint: the records kept
    # beside the SSD index still say which revision and adapter each stands for.
    async with Store(config(tmp_path)) as store:
        assert await store.evict(adapter_id="lora-a") == 4
        assert (await store.lookup(lora, tokens)).matched_tokens == 0
        assert (await store.lookup(new, tokens)).matched_tokens == 64
        assert await store.evict(namespace=new) == 4
        assert store.stats().num_blocks == 0


async def test_evict_without_invalidation_keeps_pinned_blocks(tmp_path):
    async with Store(config(tmp_path)) as store:
        tokens = random_tokens(64, seed=5)
        await store.put(NS, tokens, random_kv(SPEC, 64))
        await store.pin(NS, tokens, 60)
        assert await store.evict(tenant="acme") == 0
        assert await store.evict(revision="nope") == 0
        assert (await store.lookup(NS, tokens)).matched_tokens == 64
