"""Tenants sharing one DRAM tier: one tenant filling it cannot starve another, making room for
a tenant never deletes another's blocks it does not have to, and quotas give each its share."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os

import pytest
import torch

from kvstore import codecs
from kvstore.config import KVStoreConfig, QuotaConfig, ServerConfig, TierConfig
from kvstore.errors import CapacityError
from kvstore.page import PUBLISHED_HEADER_BYTES, PageMeta, encode_page
from kvstore.store import Store

from ..conftest import random_kv, random_tokens
from .test_chain import BLOCKS_PER_MIB, SPEC, MiB, dram, namespace

CAPACITY_MIB = 4


def one_tier(**server) -> KVStoreConfig:
    return KVStoreConfig(tiers=(TierConfig("mem", "dram", dram(CAPACITY_MIB * MiB)),),
                         server=ServerConfig(**server))


def _keys_in(store: Store, tenant: str) -> set[bytes]:
    return {row.key for row in store.list_blocks(tenant=tenant, tier="mem", limit=10_000)}


async def test_a_tenant_that_filled_dram_does_not_starve_another():
    """Regression: room-making was tenant-blind. Once acme's arena held all of DRAM, a globex
    put evicted acme's blocks one at a time without ever freeing memory globex's arena could
    grow into, and failed. Now the tier asks for a whole chunk of acme's (the store evicts
    exactly those blocks), the chunk goes back to the shared budget and globex's arena grows."""
    acme, globex = namespace(1, "acme"), namespace(2, "globex")
    async with Store(one_tier()) as store:
        for i in range(6):  # 60 blocks: a full tier, acme making room from its own blocks
            tokens = random_tokens(16 * 10, seed=30 + i)
            assert await store.put(acme, tokens, random_kv(SPEC, 16 * 10, seed=30 + i)) == 160
        assert store.stats(tenant="acme").num_blocks == CAPACITY_MIB * BLOCKS_PER_MIB
        g_tokens, g_kv = random_tokens(16 * 10, seed=50), random_kv(SPEC, 16 * 10, seed=50)
        assert await store.put(globex, g_tokens, g_kv) == 160
        assert (await store.lookup(globex, g_tokens)).tokens_per_tier == {"mem": 160}
        assert torch.equal(await store.get(globex, g_tokens), g_kv)
        # One chunk of acme's went: exactly the blocks that filled it.
        assert store.stats(tenant="acme").num_blocks == (CAPACITY_MIB - 1) * BLOCKS_PER_MIB
        globex_keys = _keys_in(store, "globex")
        for i in range(4):  # acme keeps writing: it makes room from its own blocks only
            tokens = random_tokens(16 * 10, seed=60 + i)
            assert await store.put(acme, tokens, random_kv(SPEC, 16 * 10, seed=60 + i)) == 160
        assert _keys_in(store, "globex") == globex_keys
        assert torch.equal(await store.get(globex, g_tokens), g_kv)
        # Zero-copy writes of the starved tenant find room the same way.
        reservation = await store.reserve(globex, random_tokens(16 * 5, seed=70))
        assert len(reservation.blocks) == 5
        await store.abort(reservation.reservation_id)
        assert _keys_in(store, "globex") == globex_keys


async def test_with_quotas_each_tenant_gets_its_share():
    """Two tenants with half the tier each, both writing three times their share: each ends
    with its share's worth of blocks, and the latest of them read back bit-exact."""
    acme, globex = namespace(1, "acme"), namespace(2, "globex")
    share_blocks = CAPACITY_MIB // 2 * BLOCKS_PER_MIB
    config = KVStoreConfig(tiers=(TierConfig("mem", "dram", dram(CAPACITY_MIB * MiB)),),
                           server=ServerConfig(tenant_tokens={"acme": "a", "globex": "g"}),
                           quota=QuotaConfig(tier_share=0.5))
    async with Store(config) as store:
        last = {}
        for i in range(9):  # interleaved: 90 blocks each
            for j, ns in enumerate((acme, globex)):
                tokens = random_tokens(16 * 10, seed=100 + 10 * i + j)
                kv = random_kv(SPEC, 16 * 10, seed=100 + 10 * i + j)
                assert await store.put(ns, tokens, kv) == 160
                last[ns.tenant] = (tokens, kv)
        for ns in (acme, globex):
            assert store.stats(tenant=ns.tenant).num_blocks == share_blocks
            tokens, kv = last[ns.tenant]
            assert torch.equal(await store.get(ns, tokens), kv)


async def _zero_copy_put(store: Store, ns, tokens: list[int], kv: torch.Tensor) -> int:
    """Reserve, write each page into its staging slot through a mapping (as a same-host client
    does), commit."""
    reservation = await store.reserve(ns, tokens)
    codec = codecs.get(reservation.codec)
    bt = ns.spec.block_tokens
    for grant in reservation.blocks:
        meta = PageMeta(key=grant.key, namespace=ns.fingerprint, parent=grant.parent,
                        block_index=grant.block_index, tenant=ns.tenant, model_id=ns.model_id,
                        codec=codec.name, codec_id=codec.codec_id)
        page = encode_page(meta, codec.encode(kv[:, :, grant.block_index * bt:][:, :, :bt]))
        with open(store.tiers["mem"].region_path(grant.region), "r+b") as f, \
                mmap.mmap(f.fileno(), 0) as arena:
            arena[grant.offset:grant.offset + len(page)] = page
    return await store.commit(reservation.reservation_id)


async def test_zero_copy_puts_into_a_full_tier_keep_their_staging_memory():
    """Regression: with DRAM full, a plain put took a zero-copy writer's freed staging chunk
    back to grow a published step, so the next reservation had to empty a whole step (every
    block of it, whatever their age) to grow staging again: memory went back and forth with
    every pair of puts. Now a tenant's staging memory is not its own published memory's to
    take: once the first reservation made staging room, each put, plain or zero-copy, makes
    room by evicting one block, no step is made or given back and staging keeps its size."""
    acme = namespace(1, "acme")
    async with Store(one_tier()) as store:
        tier = store.tiers["mem"]
        for i in range(6):  # a full tier
            tokens = random_tokens(16 * 10, seed=30 + i)
            assert await store.put(acme, tokens, random_kv(SPEC, 16 * 10, seed=30 + i)) == 160
        prompts = [(random_tokens(16, seed=200 + i), random_kv(SPEC, 16, seed=200 + i))
                   for i in range(40)]
        assert await _zero_copy_put(store, acme, *prompts[0]) == 16
        staging_bytes = tier.stats().extra["staging_bytes"]
        steps = set(tier.published_regions("acme"))
        dropped = store.stats().counters.dropped
        assert staging_bytes > 0
        for i, (tokens, kv) in enumerate(prompts[1:]):
            put = _zero_copy_put(store, acme, tokens, kv) if i % 2 else store.put(acme, tokens, kv)
            assert await put == 16
            assert set(tier.published_regions("acme")) == steps, i
        assert store.stats().counters.dropped - dropped == len(prompts) - 1  # one per put
        assert tier.stats().extra["staging_bytes"] == staging_bytes
        for tokens, kv in prompts[-10:]:
            assert torch.equal(await store.get(acme, tokens), kv)


async def test_a_pinned_block_does_not_stop_a_full_tier_lending_staging_slots(tmp_path):
    """Regression: in a DRAM tier full of published pages, a reservation gets staging room by
    emptying a whole step. The step chosen was the emptiest, whatever it held: when one of its
    blocks was pinned (a lease, or the background demoter copying it down), room-making refused
    the whole step and the reservation got no slot, for as long as that block stayed pinned.
    Now a step with a pinned block is passed over for another."""
    from kvstore.config import SsdConfig
    from kvstore.keys import block_keys

    acme = namespace(2, "acme")
    config = KVStoreConfig(tiers=(
        TierConfig("mem", "dram", dram(CAPACITY_MIB * MiB)),
        TierConfig("disk", "ssd", SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=64 * MiB,
                                            segment_bytes=MiB, fsync="never",
                                            admit_after_accesses=0))))
    async with Store(config) as store:
        prompts = [random_tokens(16 * 10, seed=60 + i) for i in range(12)]  # 2x the tier
        for i, tokens in enumerate(prompts):
            assert await store.put(acme, tokens, random_kv(SPEC, 16 * 10, seed=60 + i)) == 160
        tier = store.tiers["mem"]
        slot_bytes = 66 << 10
        step = tier.room_for_slot(slot_bytes, "acme").keys
        assert step, "the tier is full: a staging slot needs a step emptied"
        # Pin a block of that step the way a reader does: a lease on the prefix ending there.
        tokens, at = next((t, keys.index(k)) for t in prompts
                          for keys in [block_keys(acme, t)] for k in keys if k in step)
        lease = await store.acquire(acme, tokens[:16 * (at + 1)])
        try:
            assert lease.blocks[-1].key in step
            reservation = await store.reserve(acme, random_tokens(16 * 4, seed=99))
            assert len(reservation.blocks) == 4
            await store.abort(reservation.reservation_id)
        finally:
            await store.release(lease.lease_id)


async def _put_if_room(store: Store, ns, seed: int) -> None:
    with contextlib.suppress(CapacityError):  # no room: the put stores nothing
        await store.put(ns, random_tokens(160, seed=seed), random_kv(SPEC, 160, seed=seed))


@pytest.mark.parametrize("quotas", [True, False])
async def test_steps_a_tenants_client_keeps_mapped_are_freed_when_given_back(quotas):
    """acme's client maps every step acme is given and never lets go; each round acme fills
    3/4 of DRAM, then globex, and each empties its memory again. Regression: acme's emptied
    steps, given back to globex's growth, lingered (its client held them), and acme grew again
    into what globex let go, to hoard that too: by the second round all 8 MiB lingered and
    globex could store nothing. Now a step given back is cut down to its header page, so what
    acme's client keeps of it is 4 KiB: globex stores as much every round, and the memory
    the client holds of given-back steps stays within those pages."""
    acme, globex = namespace(1, "acme"), namespace(2, "globex")
    capacity, share = 8 * MiB, 0.75  # shares that overlap: emptied steps go to the other
    config = KVStoreConfig(tiers=(TierConfig("mem", "dram", dram(capacity)),))
    if quotas:
        config = dataclasses.replace(
            config, server=ServerConfig(tenant_tokens={"acme": "a", "globex": "g"}),
            quota=QuotaConfig(tier_share=share))
    kept: dict[str, tuple[int, mmap.mmap]] = {}
    async with Store(config) as store:
        tier = store.tiers["mem"]

        def hoard() -> None:  # what acme's client does with every step it is given
            for region in tier.published_regions("acme"):
                if region not in kept:
                    fd = os.dup(tier.region_fd(region)[1])
                    kept[region] = (fd, mmap.mmap(fd, 0, prot=mmap.PROT_READ))

        globex_blocks = []
        try:
            for i in range(6):
                for j in range(9):  # acme fills 3/4
                    await _put_if_room(store, acme, 100 * i + j)
                hoard()
                await store.evict(tenant="acme")  # its steps empty, still mapped by its client
                for j in range(9):  # globex too, taking acme's empty steps
                    await _put_if_room(store, globex, 1000 + 100 * i + j)
                globex_blocks.append(store.stats(tenant="globex").num_blocks)
                await store.evict(tenant="globex")  # its steps empty: anyone may take them
            held = tier.stats().extra["lingering_bytes"]
            given_back = set(kept) - set(tier.published_regions("acme"))
            outside = sum(os.fstat(kept[region][0]).st_blocks * 512 for region in given_back)
            print(f"lingering {held / MiB:.1f} MiB; the client keeps {outside} bytes of "
                  f"{len(given_back)} steps given back; globex's blocks by round "
                  f"{globex_blocks}")
            assert min(globex_blocks[1:]) >= globex_blocks[0]
            assert held == 0 and given_back
            assert outside <= len(given_back) * PUBLISHED_HEADER_BYTES
        finally:
            for fd, mapped in kept.values():
                mapped.close()
                os.close(fd)
