"""The store over a chain of tiers it never names: placement, atomic room-making, demotion down
the chain, promotion back up, and puts that never evict their own blocks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.config import (
    DramConfig,
    KVStoreConfig,
    QuotaConfig,
    ServerConfig,
    SsdConfig,
    TierConfig,
    config_from_mapping,
)
from kvstore.errors import CapacityError, ConfigError, InvalidArgument
from kvstore.keys import Namespace, block_keys
from kvstore.spec import KVSpec
from kvstore.store import Store

from ..conftest import random_kv, random_tokens
from ..tiers.test_ssd import flip_payload_bytes

MiB = 1 << 20
# 64 KiB of K/V per block: a raw page takes one 68 KiB slot, 15 to a 1 MiB arena chunk.
SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_tokens=16)
BLOCKS_PER_MIB = 15


def dram(capacity_bytes: int = MiB, **fields) -> DramConfig:
    # Watermarks at 1.0: blocks move down only when room is made, so counts are exact.
    return DramConfig(capacity_bytes=capacity_bytes, chunk_bytes=MiB, high_watermark=1.0,
                      low_watermark=1.0, **fields)


def ssd(tmp_path, **fields) -> SsdConfig:
    return SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=64 * MiB, segment_bytes=MiB,
                     fsync="never", admit_after_accesses=0, **fields)


def three_tiers(tmp_path, **ssd_fields) -> KVStoreConfig:
    return KVStoreConfig(tiers=(TierConfig("hot", "dram", dram()),
                                TierConfig("warm", "dram", dram()),
                                TierConfig("cold", "ssd", ssd(tmp_path, **ssd_fields))))


def namespace(seed: int = 0, tenant: str = "acme") -> Namespace:
    return Namespace(model_id=f"m{seed}", spec=SPEC, tenant=tenant)


async def test_three_tier_chain_demotes_down_and_promotes_up(tmp_path):
    """Blocks fill the first tier, spill to the second as the first makes room, then to the
    third; every block stays readable bit-exact; a get from the bottom brings blocks back up."""
    ns = namespace()
    prompts = [(random_tokens(16 * 10, seed=i), random_kv(SPEC, 16 * 10, seed=i))
               for i in range(5)]  # 50 blocks: more than the two 15-block DRAM tiers hold
    async with Store(three_tiers(tmp_path)) as store:
        assert list(store.tiers) == ["hot", "warm", "cold"]
        for tokens, kv in prompts:
            assert await store.put(ns, tokens, kv) == 160
        stats = store.stats()
        assert stats.tiers["hot"].num_blocks == BLOCKS_PER_MIB
        assert stats.tiers["warm"].num_blocks == BLOCKS_PER_MIB
        assert stats.tiers["cold"].num_blocks >= 50 - 2 * BLOCKS_PER_MIB
        assert stats.counters.demotions >= 50 - BLOCKS_PER_MIB and stats.counters.dropped == 0
        assert stats.tiers["hot"].evictions > 0 and stats.tiers["warm"].evictions > 0
        oldest_tokens, oldest_kv = prompts[0]
        hit = await store.lookup(ns, oldest_tokens)
        assert hit.matched_tokens == 160 and set(hit.tokens_per_tier) <= {"warm", "cold"}
        assert torch.equal(await store.get(ns, oldest_tokens), oldest_kv)
        for _ in range(100):  # promotion into the fastest tier runs in the background
            if (await store.lookup(ns, oldest_tokens)).tokens_per_tier.get("hot") == 160:
                break
            await asyncio.sleep(0.02)
        assert (await store.lookup(ns, oldest_tokens)).tokens_per_tier == {"hot": 160}
        for tokens, kv in prompts:
            assert torch.equal(await store.get(ns, tokens), kv)
        assert {row.tiers[0] for row in store.list_blocks(limit=100)} <= {"hot", "warm", "cold"}
        removed = 0
        for _ in range(100):  # blocks pinned by promotions still running are skipped
            removed += await store.evict(model_id=ns.model_id)
            if removed == 50:
                break
            await asyncio.sleep(0.02)
        assert removed == 50 and store.stats().num_blocks == 0


async def test_codecs_are_per_tier_and_pages_transcode_on_the_way_down(tmp_path):
    ns = namespace()
    tokens, kv = random_tokens(16 * 40, seed=3), random_kv(SPEC, 16 * 40, seed=3)
    async with Store(three_tiers(tmp_path, codec="fp8_e4m3")) as store:
        await store.put(ns, tokens, kv)
        cold = [row for row in store.list_blocks(limit=100) if row.tiers == ("cold",)]
        assert cold
        got = await store.get(ns, tokens)
        assert got.shape == kv.shape
        first_cold = min(row.block_index for row in cold) * 16
        # Raw tiers above are exact; fp8 below is close, not exact.
        assert torch.equal(got[:, :, :first_cold], kv[:, :, :first_cold])
        error = (got.float() - kv.float()).abs().max().item()
        assert 0 < error < 0.2 * kv.float().abs().max().item()


async def test_a_put_never_evicts_its_own_blocks(tmp_path):
    """One tier of 15 blocks, a prompt of 40: the put stores what fits and says so exactly,
    instead of evicting its own earlier blocks to make room for later ones."""
    ns = namespace()
    config = KVStoreConfig(tiers=(TierConfig("only", "dram", dram()),))
    tokens, kv = random_tokens(16 * 40, seed=1), random_kv(SPEC, 16 * 40, seed=1)
    async with Store(config) as store:
        written = await store.put(ns, tokens, kv)
        assert written == 16 * BLOCKS_PER_MIB
        assert (await store.lookup(ns, tokens)).matched_tokens == written
        assert torch.equal(await store.get(ns, tokens), kv[:, :, :written])
        # A second prompt does evict the first one's blocks (they are not its own).
        other_tokens, other_kv = random_tokens(16 * 3, seed=2), random_kv(SPEC, 16 * 3, seed=2)
        assert await store.put(ns, other_tokens, other_kv) == 48
        assert store.stats().counters.dropped == 3


async def test_a_page_no_tier_can_hold_is_refused_without_evicting(tmp_path):
    ns = namespace()
    config = KVStoreConfig(tiers=(TierConfig("only", "dram", dram()),))
    huge = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)  # 2 MiB pages
    async with Store(config) as store:
        tokens, kv = random_tokens(16 * 5), random_kv(SPEC, 16 * 5)
        assert await store.put(ns, tokens, kv) == 80
        with pytest.raises(CapacityError, match="bytes"):
            await store.put(Namespace(model_id="big", spec=huge), random_tokens(16),
                            random_kv(huge, 16))
        assert store.stats().tiers["only"].num_blocks == 5
        assert store.stats().tiers["only"].evictions == 0


async def test_making_room_takes_only_blocks_of_the_size_class_that_frees_it(tmp_path):
    """A full arena of one slot class and a page of another class: evicting slots of the wrong
    class would not free room, so none is evicted; the page goes down the chain instead."""
    config = KVStoreConfig(tiers=(TierConfig("mem", "dram", dram()),
                                  TierConfig("disk", "ssd", ssd(tmp_path))))
    small = namespace(1)
    other_spec = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, block_tokens=16)
    other = Namespace(model_id="half", spec=other_spec, tenant="acme")
    async with Store(config) as store:
        tokens, kv = random_tokens(16 * 15, seed=4), random_kv(SPEC, 16 * 15, seed=4)
        assert await store.put(small, tokens, kv) == 240
        assert store.stats().tiers["mem"].num_blocks == 15
        other_tokens = random_tokens(16, seed=5)
        assert await store.put(other, other_tokens, random_kv(other_spec, 16, seed=5)) == 16
        stats = store.stats()
        assert stats.tiers["mem"].num_blocks == 15 and stats.tiers["mem"].evictions == 0
        assert (await store.lookup(other, other_tokens)).tokens_per_tier == {"disk": 16}


async def test_a_dead_writers_reservation_does_not_hold_a_prefix_back(tmp_path):
    """A writer reserves slots and dies before committing: another put of the same prefix
    stores it at once (not after the lease timeout); the late commit frees its slots and
    publishes nothing (its blocks are stored: their slots, never written, are not even read)."""
    ns = namespace()
    config = KVStoreConfig(tiers=(TierConfig("mem", "dram", dram(4 * MiB)),))
    tokens, kv = random_tokens(16 * 4, seed=6), random_kv(SPEC, 16 * 4, seed=6)
    async with Store(config) as store:
        reservation = await store.reserve(ns, tokens, lease_s=600)
        assert len(reservation.blocks) == 4
        used_with_slots = store.stats().tiers["mem"].used_bytes
        written = await asyncio.wait_for(store.put(ns, tokens, kv), timeout=5)
        assert written == 64 and (await store.lookup(ns, tokens)).matched_tokens == 64
        assert store.stats().tiers["mem"].used_bytes == 2 * used_with_slots
        assert await store.commit(reservation.reservation_id) == 0
        assert store.stats().tiers["mem"].used_bytes == used_with_slots
        assert torch.equal(await store.get(ns, tokens), kv)


def test_tier_chain_from_toml_tables(tmp_path):
    config = config_from_mapping({"tiers": [
        {"name": "hot", "kind": "dram", "capacity_bytes": "2MiB", "chunk_bytes": "1MiB"},
        {"name": "cold", "kind": "ssd", "path": str(tmp_path), "codec": "fp8_e4m3+zstd",
         "admit_after_accesses": 1},
    ]})
    chain = config.tier_chain()
    assert [(t.name, t.kind) for t in chain] == [("hot", "dram"), ("cold", "ssd")]
    assert chain[0].settings.capacity_bytes == 2 * MiB
    assert chain[1].settings.codec == "fp8_e4m3+zstd"
    assert [t.name for t in KVStoreConfig().tier_chain()] == ["dram", "ssd"]
    with pytest.raises(ConfigError, match="kind"):
        config_from_mapping({"tiers": [{"name": "x", "kind": "tape"}]})
    with pytest.raises(ConfigError, match="unique"):
        config_from_mapping({"tiers": [{"name": "x", "kind": "dram"},
                                       {"name": "x", "kind": "dram"}]})
    with pytest.raises(ConfigError, match="tiers.hot.capacity_bytes"):
        config_from_mapping({"tiers": [{"name": "hot", "kind": "dram", "capacity_bytes": "lots"}]})


async def test_restart_rebuilds_the_directory_from_every_persistent_tier(tmp_path):
    ns = namespace()
    tokens, kv = random_tokens(16 * 20, seed=8), random_kv(SPEC, 16 * 20, seed=8)
    async with Store(three_tiers(tmp_path, persist_on_close=True)) as store:
        assert await store.put(ns, tokens, kv) == 320
    async with Store(three_tiers(tmp_path)) as store:
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"cold": 320}
        assert torch.equal(await store.get(ns, tokens), kv)
        keys = block_keys(ns, tokens)
        assert [row.key for row in store.list_blocks(tier="cold", limit=100)
                if row.key in set(keys)]


def two_tenants(**quota) -> KVStoreConfig:
    return KVStoreConfig(tiers=(TierConfig("mem", "dram", dram(2 * MiB)),),
                         server=ServerConfig(tenant_tokens={"acme": "a", "globex": "g"}),
                         quota=QuotaConfig(**quota))


async def test_one_tenant_cannot_flush_another(tmp_path):
    """Two tenants share a tier half and half: a tenant writing far more than its share evicts
    only its own blocks; the other tenant keeps every block it stored within its share."""
    acme, globex = namespace(1, "acme"), namespace(2, "globex")
    a_tokens, a_kv = random_tokens(16 * 10, seed=10), random_kv(SPEC, 16 * 10, seed=10)
    async with Store(two_tenants()) as store:
        assert await store.put(acme, a_tokens, a_kv) == 160
        for i in range(6):  # 60 blocks: four times globex's share
            tokens = random_tokens(16 * 10, seed=20 + i)
            assert await store.put(globex, tokens, random_kv(SPEC, 16 * 10, seed=20 + i)) > 0
        assert (await store.lookup(acme, a_tokens)).matched_tokens == 160
        assert torch.equal(await store.get(acme, a_tokens), a_kv)
        assert store.stats(tenant="acme").num_blocks == 10
        assert store.stats(tenant="globex").num_blocks <= BLOCKS_PER_MIB
        # Reservations count against the share too: globex cannot reserve acme's half.
        reservation = await store.reserve(globex, random_tokens(16 * 40, seed=40))
        assert len(reservation.blocks) <= BLOCKS_PER_MIB
        assert (await store.lookup(acme, a_tokens)).matched_tokens == 160
        await store.abort(reservation.reservation_id)


async def test_open_leases_and_reservations_are_capped_per_tenant(tmp_path):
    acme, globex = namespace(1, "acme"), namespace(2, "globex")
    tokens, kv = random_tokens(16 * 2, seed=11), random_kv(SPEC, 16 * 2, seed=11)
    async with Store(two_tenants(max_open_leases=2, max_open_reservations=1)) as store:
        await store.put(acme, tokens, kv)
        leases = [await store.acquire(acme, tokens) for _ in range(2)]
        with pytest.raises(CapacityError, match="lease"):
            await store.acquire(acme, tokens)
        await store.put(globex, tokens, kv)
        other = await store.acquire(globex, tokens)  # another tenant's cap is its own
        await store.release(leases[0].lease_id)
        leases[0] = await store.acquire(acme, tokens)
        first = await store.reserve(acme, random_tokens(32, seed=12))
        with pytest.raises(CapacityError, match="reservation"):
            await store.reserve(acme, random_tokens(32, seed=13))
        await store.abort(first.reservation_id)
        await store.abort((await store.reserve(acme, random_tokens(32, seed=13))).reservation_id)
        for lease in [*leases, other]:
            await store.release(lease.lease_id)


async def test_long_prefixes_are_hashed_in_slices_that_yield(tmp_path):
    """One maximal request must not stall every other: keys of a prefix over one slice
    (``SLICE_BLOCKS``) are hashed a slice at a time, the loop free between slices; short ones
    in one go. (A worker thread did not free the loop: hashing holds the GIL.)"""
    from kvstore.store.slices import SLICE_BLOCKS

    ns = namespace()
    config = KVStoreConfig(tiers=(TierConfig("mem", "dram", dram()),))
    async with Store(config) as store:
        await store.lookup(ns, random_tokens(64))
        assert store.share.num_pauses == 0
        await store.lookup(ns, random_tokens((3 * SLICE_BLOCKS + 1) * SPEC.block_tokens))
        assert store.share.num_pauses >= 3


async def test_lookup_advises_fetching_the_fast_head_and_recomputing_the_slow_tail(tmp_path):
    """DRAM holds the head of a prefix and a (modelled) slow SSD the tail: with a model profile,
    lookups advise fetching only the DRAM part; without one, they give no advice; an engine
    that reports slower prefills moves the advice to fetching everything."""
    from kvstore.policy.cost import ModelProfile

    slow_ssd = ssd(tmp_path, read_bytes_per_s=1e6, read_fixed_s=0.0)  # ~70 ms per block
    config = KVStoreConfig(tiers=(TierConfig("mem", "dram", dram(read_bytes_per_s=10e9)),
                                  TierConfig("disk", "ssd", slow_ssd)))
    ns = namespace()
    tokens, kv = random_tokens(16 * 20, seed=30), random_kv(SPEC, 16 * 20, seed=30)
    async with Store(config) as store:
        assert await store.put(ns, tokens, kv) == 320  # 15 blocks in DRAM, 5 on SSD
        hit = await store.lookup(ns, tokens)
        assert hit.tokens_per_tier == {"mem": 240, "disk": 80} and hit.advised_tokens is None
        # ~1 ms of prefill per 16-token block: DRAM reads (~7 us) win, SSD reads (~70 ms) lose.
        profile = ModelProfile(num_params=1e9, num_layers=4, hidden_size=256, flops_per_s=3.2e13)
        store.set_model_profile(ns, profile)
        assert (await store.lookup(ns, tokens)).advised_tokens == 240
        for _ in range(200):  # the engine reports prefills 1000x slower than the profile
            store.report_prefill(ns, 320, 0, 1000 * 2 * 1e9 * 320 / 3.2e13)
        advised = (await store.lookup(ns, tokens)).advised_tokens
        assert advised == 320
        # Profiles and reports are per tenant: another tenant's lookups get no advice from them.
        other = namespace(0, tenant="globex")
        await store.put(other, tokens, kv)
        assert (await store.lookup(other, tokens)).advised_tokens is None


async def test_hints_schedule_only_blocks_that_can_arrive_before_the_deadline(tmp_path):
    """The SSD path is modelled at 10 MB/s (~7 ms a 68 KiB block): a 35 ms deadline fits the
    first few blocks of the prefix, in prefix order, and no more; a generous one fits all."""
    config = KVStoreConfig(tiers=(
        TierConfig("mem", "dram", dram(4 * MiB)),
        TierConfig("disk", "ssd", ssd(tmp_path, read_bytes_per_s=10e6, read_fixed_s=0.0,
                                      persist_on_close=True))))
    ns = namespace()
    tokens, kv = random_tokens(16 * 12, seed=31), random_kv(SPEC, 16 * 12, seed=31)
    async with Store(config) as store:
        await store.put(ns, tokens, kv)
    async with Store(config) as store:  # a restart: every block is on SSD only
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"disk": 192}
        scheduled = await store.hint(ns, tokens, deadline_s=0.035)
        assert 1 <= scheduled < 12
        for _ in range(200):
            counters = store.stats().counters
            if counters.hint_landed + counters.hint_late == scheduled:
                break
            await asyncio.sleep(0.01)
        assert counters.hint_blocks == scheduled and counters.hint_skipped == 12 - scheduled
        # On a busy machine some land after the deadline (late): they are promoted all the same.
        promoted = counters.hint_landed + counters.hint_late
        hit = await store.lookup(ns, tokens)
        assert hit.tokens_per_tier.get("mem", 0) == 16 * promoted
        assert await store.hint(ns, tokens, deadline_s=60) == 12 - promoted
        assert torch.equal(await store.get(ns, tokens), kv)


async def test_a_block_a_lower_codec_refuses_never_breaks_other_puts(tmp_path):
    """Regression: a raw DRAM page of NaN K/V (accepted: raw stores what the engine computed)
    could not be re-encoded for an fp8 SSD, and that CodecError escaped the demotion into the
    put that was making room, failing another model's put. The failure now stays with the
    block: it is not demoted (dropped when room is needed), and every other put goes on."""
    config = KVStoreConfig(tiers=(TierConfig("mem", "dram", dram()),
                                  TierConfig("disk", "ssd", ssd(tmp_path, codec="fp8_e4m3"))))
    poisoned, other = namespace(1, "acme"), namespace(2, "acme")
    nan_kv = torch.full(SPEC.shape(16 * 10), float("nan"), dtype=torch.bfloat16)
    async with Store(config) as store:
        assert await store.put(poisoned, random_tokens(160, seed=50), nan_kv) == 160
        for i in range(4):  # 40 more blocks push the NaN blocks out of the 15-block DRAM tier
            tokens, kv = random_tokens(160, seed=60 + i), random_kv(SPEC, 160, seed=60 + i)
            assert await store.put(other, tokens, kv) == 160
            got = await store.get(other, tokens)
            assert got is not None and got.shape == kv.shape
        assert store.stats().counters.dropped >= 10


def _dram_and_ssd(tmp_path) -> KVStoreConfig:
    return KVStoreConfig(tiers=(TierConfig("hot", "dram", dram()),
                                TierConfig("cold", "ssd", ssd(tmp_path))))


async def _on_the_ssd_only(store: Store, ns: Namespace, tokens, kv) -> None:
    """Put ``tokens`` and push them out of the DRAM tier with another prompt."""
    await store.put(ns, tokens, kv)
    await store.put(ns, random_tokens(16 * BLOCKS_PER_MIB, seed=99),
                    random_kv(SPEC, 16 * BLOCKS_PER_MIB, seed=99))
    assert (await store.lookup(ns, tokens)).tokens_per_tier == {"cold": len(tokens)}


async def test_an_acquire_brings_an_ssd_prefix_in_and_leases_from_first_block(tmp_path):
    """Ten blocks only the SSD holds: one acquire promotes them (several at once) and leases
    all ten in prefix order; first_block leases the tail only, with matched_tokens still
    counted from the prompt's start; a first_block past the match leases nothing."""
    ns = namespace()
    tokens, kv = random_tokens(16 * 10, seed=21), random_kv(SPEC, 16 * 10, seed=21)
    async with Store(_dram_and_ssd(tmp_path)) as store:
        await _on_the_ssd_only(store, ns, tokens, kv)
        lease = await store.acquire(ns, tokens)
        assert lease.matched_tokens == 160 and len(lease.blocks) == 10
        assert [lease.blocks.key(i) for i in range(10)] == block_keys(ns, tokens)
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"hot": 160}
        tail = await store.acquire(ns, tokens, first_block=4)
        assert tail.matched_tokens == 160 and len(tail.blocks) == 6
        assert [tail.blocks.key(i) for i in range(6)] == block_keys(ns, tokens)[4:]
        past = await store.acquire(ns, tokens, first_block=12)
        assert past.matched_tokens == 160 and len(past.blocks) == 0
        for held in (lease, tail, past):
            await store.release(held.lease_id)
        with pytest.raises(InvalidArgument, match="first_block"):
            await store.acquire(ns, tokens, first_block=-1)
        assert store.stats().active_leases == 0


async def test_an_acquire_stops_at_the_first_block_that_cannot_be_brought_in(tmp_path):
    """Block 5 of ten is damaged on the SSD: the lease holds blocks 0-4 only, none after the
    gap, even though promotions of later blocks were in flight beside it."""
    ns = namespace()
    tokens, kv = random_tokens(16 * 10, seed=22), random_kv(SPEC, 16 * 10, seed=22)
    async with Store(_dram_and_ssd(tmp_path)) as store:
        await _on_the_ssd_only(store, ns, tokens, kv)
        flip_payload_bytes(tmp_path / "ssd", kv[0, 0, 80:96].contiguous().view(
            torch.uint8).numpy().tobytes())
        lease = await store.acquire(ns, tokens)
        assert lease.matched_tokens == 80 and len(lease.blocks) == 5
        assert [lease.blocks.key(i) for i in range(5)] == block_keys(ns, tokens)[:5]
        await store.release(lease.lease_id)
        assert torch.equal(await store.get(ns, tokens), kv[:, :, :80])
