"""The HBM tier in the store's chain: device pages in per-tenant pools, written by engine
kernels through reservations, demoted down the chain as host pages and promoted back.

Runs on the GPU when there is one (``pytest -m gpu`` picks the CUDA cases), otherwise on the
tier's host-memory pools with the kernels in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kvstore.api import Medium
from kvstore.codecs.device import device_layout
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.config import ConfigError, DramConfig, HbmConfig, KVStoreConfig, TierConfig
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace
from kvstore.spec import EngineLayout, KVSpec
from kvstore.store import Store

from ..conftest import random_kv, random_tokens

MiB = 1 << 20
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_tokens=16)  # 8 KiB a block
DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                   reason="needs CUDA or TRITON_INTERPRET=1")


def chain(hbm_bytes: int, codec: str = "raw") -> KVStoreConfig:
    return KVStoreConfig(tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=hbm_bytes, device=DEVICE, codec=codec,
                                           high_watermark=1.0, low_watermark=1.0)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB,
                                              high_watermark=1.0, low_watermark=1.0)),
    ))


def namespace(tenant: str = "acme") -> Namespace:
    return Namespace(model_id="m", spec=SPEC, tenant=tenant)


def assert_pool_holds(pool: torch.Tensor, lease, kv: torch.Tensor) -> None:
    """Each leased raw device page in ``pool`` holds its block of ``kv``, where the lease says."""
    layout = device_layout("raw", SPEC)
    for i, block in enumerate(lease.blocks):
        assert block.length == layout.nbytes and block.offset % 256 == 0
        got = pool[block.offset:block.offset + layout.nbytes].view(torch.bfloat16)
        want = kv[:, :, 16 * i:16 * (i + 1)].contiguous().flatten()
        assert torch.equal(got.cpu(), want)


async def test_puts_land_in_hbm_spill_to_dram_and_come_back_exact():
    ns = namespace()
    slot = device_layout("raw", SPEC).nbytes
    prompts = [(random_tokens(16 * 4, seed=i), random_kv(SPEC, 16 * 4, seed=i)) for i in range(5)]
    async with Store(chain(6 * slot)) as store:  # 6 blocks of HBM, 20 blocks written
        for tokens, kv in prompts:
            assert await store.put(ns, tokens, kv) == 64
        stats = store.stats()
        assert stats.tiers["gpu"].num_blocks == 6
        assert stats.tiers["host"].num_blocks == 14 and stats.counters.dropped == 0
        # A device lease promotes the prefix into the tenant's pool and says where it is.
        lease = await store.acquire(ns, prompts[0][0], medium=Medium.DEVICE)
        assert lease.matched_tokens == 64 and lease.codec == "raw"
        assert {b.medium for b in lease.blocks} == {Medium.DEVICE}
        assert_pool_holds(store.tiers["gpu"].pool_tensor("acme"), lease, prompts[0][1])
        await store.release(lease.lease_id)
        for tokens, kv in prompts:
            assert torch.equal(await store.get(ns, tokens), kv)
        # A host lease of the same prefix is served from DRAM, never from device memory.
        host = await store.acquire(ns, prompts[0][0])
        assert host.matched_tokens == 64 and {b.medium for b in host.blocks} == {Medium.HOST}
        await store.release(host.lease_id)


@needs_kernels
@pytest.mark.parametrize("codec", ["raw", "fp8_e4m3", "nvfp4", "mxfp4"])
async def test_engine_writes_device_slots_and_the_store_serves_them(codec):
    """A writer reserves device slots, encodes its paged cache into them with the engine
    kernel, commits; a get (through the tier's host page) returns what the cache held."""
    from kvstore.codecs.triton.engine import from_engine

    ns = namespace()
    tokens = random_tokens(16 * 3, seed=7)
    kv = random_kv(SPEC, 48, seed=7)
    caches = [torch.full((2, 8, 16, 2, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
              for _ in range(SPEC.num_layers)]
    layout = EngineLayout.of(caches, SPEC)
    pages = [5, 1, 6]
    for i, page in enumerate(pages):
        for layer in range(SPEC.num_layers):
            caches[layer][:, page] = kv[layer, :, 16 * i:16 * (i + 1)].to(DEVICE)
    async with Store(chain(16 * device_layout(codec, SPEC).nbytes, codec)) as store:
        res = await store.reserve(ns, tokens, medium=Medium.DEVICE)
        assert res.codec == codec and len(res.blocks) == 3
        pool = store.tiers["gpu"].pool_tensor("acme")
        from_engine(layout, device_layout(codec, SPEC),
                    [pool.data_ptr() + g.offset for g in res.blocks], pages)
        assert await store.commit(res.reservation_id) == 48
        got = await store.get(ns, tokens)
        if codec == "raw":
            assert torch.equal(got, kv)
        else:
            rel = (got.float() - kv.float()).norm() / kv.float().norm()
            assert 0 < rel < (0.05 if codec == "fp8_e4m3" else 0.2)
        assert (await store.lookup(ns, tokens)).tokens_per_tier == {"gpu": 48}


async def test_device_tier_refuses_what_it_cannot_hold():
    with pytest.raises(ConfigError, match="engine kernels"):
        HbmConfig(codec="int2")
    with pytest.raises(ConfigError, match="pool_bytes"):
        HbmConfig(capacity_bytes=MiB, pool_bytes=2 * MiB)
    async with Store(chain(MiB)) as store:
        ns = namespace()
        res = await store.reserve(ns, random_tokens(32), medium=Medium.DEVICE)
        with pytest.raises(InvalidArgument, match="ready.event"):
            await store.commit(res.reservation_id, ready_event=b"\x01" * 64)


async def test_tenants_get_pools_of_their_own():
    slot = device_layout("raw", SPEC).nbytes
    config = KVStoreConfig(tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=8 * slot, pool_bytes=4 * slot,
                                           device=DEVICE)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB)),
    ))
    async with Store(config) as store:
        a, b = namespace("a"), namespace("b")
        tokens = random_tokens(64, seed=1)
        await store.put(a, tokens, random_kv(SPEC, 64, seed=1))
        await store.put(b, tokens, random_kv(SPEC, 64, seed=2))
        la = await store.acquire(a, tokens, medium=Medium.DEVICE)
        lb = await store.acquire(b, tokens, medium=Medium.DEVICE)
        assert la.blocks[0].region != lb.blocks[0].region
        tier = store.tiers["gpu"]
        assert tier.pool_tensor("a").data_ptr() != tier.pool_tensor("b").data_ptr()
        assert store.stats().tiers["gpu"].extra["pools"] == 2


async def test_a_tenant_filling_its_pool_evicts_only_its_own_blocks():
    slot = device_layout("raw", SPEC).nbytes
    config = KVStoreConfig(tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=8 * slot, pool_bytes=4 * slot,
                                           device=DEVICE, high_watermark=1.0,
                                           low_watermark=1.0)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB)),
    ))
    async with Store(config) as store:
        a, b = namespace("a"), namespace("b")
        b_tokens = random_tokens(64, seed=9)
        await store.put(b, b_tokens, random_kv(SPEC, 64, seed=9))
        for i in range(4):  # a writes four pools' worth
            await store.put(a, random_tokens(64, seed=i), random_kv(SPEC, 64, seed=i))
        assert (await store.lookup(b, b_tokens)).tokens_per_tier == {"gpu": 64}
        assert store.tiers["gpu"].stats().num_blocks == 8



# A tier of two devices: two GPUs where the host has them, else two host-memory "devices"
# (the placement logic is the same; peer access is the GPU tests' part).
PAIR = ("cuda:0,cuda:1" if torch.cuda.is_available() and torch.cuda.device_count() > 1
        else "cpu:0,cpu:1")


def two_devices(slots_each: int, pool_slots: int = 0) -> KVStoreConfig:
    slot = device_layout("raw", SPEC).nbytes
    return KVStoreConfig(tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=slots_each * slot, device=PAIR,
                                           pool_bytes=pool_slots * slot,
                                           high_watermark=1.0, low_watermark=1.0)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=4 * MiB, chunk_bytes=MiB,
                                              high_watermark=1.0, low_watermark=1.0)),
    ))


def test_the_device_list_is_checked():
    assert HbmConfig(device="cuda").device_list() == ["cuda:0"]
    assert HbmConfig(device="cuda:0, cuda:3").device_list() == ["cuda:0", "cuda:3"]
    for bad in ("cuda:0,cuda:0", "cpu,cuda:0", "gpu0", "cuda:x", ""):
        with pytest.raises(ConfigError, match="hbm.device"):
            HbmConfig(device=bad)


async def test_a_tier_of_two_devices_lends_slots_on_the_writers_device_then_the_other():
    from kvstore.ipc import device_id

    async with Store(two_devices(8, pool_slots=4)) as store:
        tier = store.tiers["gpu"]
        first, second = tier.devices
        assert tier.capacity_bytes == 16 * device_layout("raw", SPEC).nbytes
        ns = namespace()
        # Six blocks asked for on the second device, which has room for four.
        res = await store.reserve(ns, random_tokens(96, seed=3), medium=Medium.DEVICE,
                                  device=device_id(second))
        grants = res.blocks
        assert len(grants) == 6 and len(grants.regions) == 2
        assert [grants.regions[i] for i in grants.region_index] == (
            [grants.regions[0]] * 4 + [grants.regions[1]] * 2)
        await store.commit(res.reservation_id)
        pools = {tier.device_of(g.key) for g in grants[:4]}, {tier.device_of(g.key)
                                                             for g in grants[4:]}
        assert pools == ({second}, {first})
        extra = store.stats().tiers["gpu"].extra
        assert (extra["pools"], extra["pool_bytes"], extra["devices"]) == (
            2, tier.capacity_bytes // 2, 2)
        # A request naming no device (or one the tier does not have) starts on the first.
        other = await store.reserve(namespace("other"), random_tokens(32, seed=4),
                                    medium=Medium.DEVICE, device="GPU-not-one-of-these")
        assert list(other.blocks.regions) == [tier.region_of("other")]
        await store.commit(other.reservation_id)
        assert {tier.device_of(g.key) for g in other.blocks} == {first}


async def test_a_lease_promotes_into_the_readers_device():
    from kvstore.ipc import device_id

    async with Store(two_devices(4)) as store:
        tier = store.tiers["gpu"]
        _, second = tier.devices
        ns = namespace()
        prompts = [(random_tokens(64, seed=i), random_kv(SPEC, 64, seed=i)) for i in range(3)]
        for tokens, kv in prompts:  # 12 blocks, 8 of HBM: the first prompt goes down to DRAM
            assert await store.put(ns, tokens, kv) == 64
        assert (await store.lookup(ns, prompts[0][0])).tokens_per_tier == {"host": 64}
        lease = await store.acquire(ns, prompts[0][0], medium=Medium.DEVICE,
                                    device=device_id(second))
        assert lease.matched_tokens == 64
        assert {tier.device_of(b.key) for b in lease.blocks} == {second}
        assert len(lease.blocks.regions) == 1
        assert_pool_holds(tier.pool_tensor("acme", 1), lease, prompts[0][1])
        await store.release(lease.lease_id)
        for tokens, kv in prompts:
            assert torch.equal(await store.get(ns, tokens), kv)
