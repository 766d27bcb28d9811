"""The engine's GPU path end to end: an engine cache registered with a real daemon, saved by
block ids and loaded into another cache, through the daemon's device pool or its host path.

On a machine without CUDA the pool is host memory and the kernels run in Triton's interpreter
(the daemon runs in this process, so its host pool is mappable); on a GPU it is a CUDA IPC pool.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstore.client import Client
from kvstore.client.engine import EngineCache
from kvstore.codecs.triton.common import kernels_runnable
from kvstore.config import DramConfig, HbmConfig, TierConfig
from kvstore.keys import Namespace
from kvstore.spec import KVSpec

from ..server.helpers import DaemonThread, rpc_calls, small_config, wait_for

DEVICE = "cuda:0" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_runnable(torch.device(DEVICE)),
                                reason="needs CUDA or TRITON_INTERPRET=1")
SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=32, block_tokens=16)
MiB = 1 << 20
PAGES = 12


def with_hbm(config, codec: str = "raw"):
    return dataclasses.replace(config, tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=4 * MiB, device=DEVICE, codec=codec)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=8 * MiB, chunk_bytes=MiB)),
    ))


def engine(poison: bool) -> list[torch.Tensor]:
    shape = (2, PAGES, SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim)  # FlashAttention
    if poison:
        return [torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
                for _ in range(SPEC.num_layers)]
    return [torch.randn(shape, device=DEVICE).to(torch.bfloat16) for _ in range(SPEC.num_layers)]


def same_pages(a: list[torch.Tensor], pa: list[int], b: list[torch.Tensor], pb: list[int]
               ) -> bool:
    return all(torch.equal(x[:, pa], y[:, pb]) for x, y in zip(a, b))


@pytest.mark.parametrize("tiers", ["hbm", "host"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_save_then_load_into_another_cache(tmp_path, tiers, layerwise):
    config = small_config(tmp_path)
    if tiers == "hbm":
        config = with_hbm(config)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(100, 100 + 5 * 16 + 7))  # five whole blocks and a partial one
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        src = engine(poison=False)
        saver = EngineCache(client, ns, src)
        src_pages = [7, 2, 9, 0, 4, 11]
        assert saver.save(tokens, src_pages) == 80
        assert saver.save(tokens, src_pages) == 0  # already stored
        hit = client.lookup(ns, tokens)
        assert hit.matched_tokens == 80
        assert set(hit.tokens_per_tier) == ({"gpu"} if tiers == "hbm" else {"dram"})

        dst = engine(poison=True)
        with EngineCache(client, ns, dst) as loader:
            dst_pages = [3, 5, 1, 10, 8]
            handle = loader.load(tokens, dst_pages, layerwise=layerwise)
            for layer in range(SPEC.num_layers):
                handle.wait_for_layer(layer)
            assert handle.wait() == 80
        assert handle.source == ("device pool" if tiers == "hbm" else "host arena")
        assert same_pages(src, src_pages[:5], dst, dst_pages)
        untouched = [p for p in range(PAGES) if p not in dst_pages]
        assert all(torch.isnan(t[:, untouched]).all() for t in dst)
        # Leases were given back: the daemon holds none.
        stats = client.stats()
        assert stats.active_leases == 0 and stats.active_reservations == 0


def test_a_host_load_brings_an_ssd_prefix_in_piece_by_piece(tmp_path):
    """A daemon restarted over its SSD holds the prefix there only: the host load leases it in
    pieces of 2, 4, then the last block, each brought into the arena and decoded into its
    engine pages; every lease goes back. Loaded again, from the arena now, it is one lease."""
    config = small_config(tmp_path, ssd={"write_through": True})
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(7 * 16))
    src, src_pages = engine(poison=False), [0, 1, 2, 3, 4, 5, 6]
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        assert EngineCache(client, ns, src).save(tokens, src_pages) == 112
        # the write-through to the SSD runs in the background
        assert wait_for(lambda: client.stats().tiers["ssd"].num_blocks == 7)

    def acquires(daemon) -> int:
        return rpc_calls(daemon, "Acquire")

    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        assert client.lookup(ns, tokens).tokens_per_tier == {"ssd": 112}
        dst = engine(poison=True)
        with EngineCache(client, ns, dst) as loader:
            loader.FIRST_PIECE_BLOCKS = 2
            # the probe for a device pool (none here) and three pieces; then, the arena's
            # tier known and the lookup showing it holds the prefix, one lease
            for dst_pages, leases in (([9, 5, 11, 6, 8, 7, 10], 4), ([0, 1, 2, 3, 4, 5, 6], 1)):
                for t in dst:
                    t.fill_(float("nan"))
                before = acquires(daemon)
                handle = loader.load(tokens, dst_pages, advice=False)
                assert handle.wait() == 112 and handle.source == "host arena"
                assert acquires(daemon) - before == leases
                assert same_pages(src, src_pages, dst, dst_pages)
                untouched = [p for p in range(PAGES) if p not in dst_pages]
                assert all(torch.isnan(t[:, untouched]).all() for t in dst)
                assert client.lookup(ns, tokens).tokens_per_tier == {"dram": 112}
        assert client.stats().active_leases == 0
        assert client.stats().counters.promotions >= 7


def test_a_daemon_that_leases_no_pieces_gets_one_whole_lease(tmp_path, monkeypatch):
    """A daemon from before pieces ignores first_block and names no tier in its leases: the
    load sees that on its first piece and leases the whole prefix at once instead, so no
    page lands in the wrong engine page."""
    from kvstore.store import leases

    acquire = leases.LeaseManager.acquire

    async def older(self, ns, keys, lease_s, medium=leases.Medium.HOST, first_block=0,
                    device=""):
        lease = await acquire(self, ns, keys, lease_s, medium)
        return dataclasses.replace(lease, tier="")

    monkeypatch.setattr(leases.LeaseManager, "acquire", older)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(5 * 16))
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        src, src_pages = engine(poison=False), [0, 1, 2, 3, 4]
        EngineCache(client, ns, src).save(tokens, src_pages)
        dst = engine(poison=True)
        with EngineCache(client, ns, dst) as loader:
            loader.FIRST_PIECE_BLOCKS = 2
            for dst_pages in ([9, 5, 11, 6, 8], [1, 2, 3, 4, 0]):
                assert loader.load(tokens, dst_pages, advice=False).wait() == 80
                assert same_pages(src, src_pages, dst, dst_pages)
        assert client.stats().active_leases == 0


@pytest.mark.parametrize(("codec", "tolerance"), [("fp8_e4m3", 0.05), ("nvfp4", 0.15),
                                                  ("mxfp4", 0.2)])
def test_lossy_pool_loads_within_codec_tolerance(tmp_path, codec, tolerance):
    config = with_hbm(small_config(tmp_path), codec=codec)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(3 * 16))
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        src = engine(poison=False)
        EngineCache(client, ns, src).save(tokens, [1, 2, 3])
        dst = engine(poison=True)
        assert EngineCache(client, ns, dst).load(tokens, [4, 5, 6]).wait() == 48
        for x, y in zip(src, dst):
            a, b = x[:, [1, 2, 3]].float(), y[:, [4, 5, 6]].float()
            assert not torch.isnan(b).any()
            assert 0 < ((a - b).norm() / a.norm()).item() < tolerance


def test_a_load_past_the_stored_prefix_stops_at_it(tmp_path):
    config = with_hbm(small_config(tmp_path))
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        src = engine(poison=False)
        EngineCache(client, ns, src).save(list(range(32)), [0, 1])
        dst = engine(poison=True)
        cache = EngineCache(client, ns, dst)
        assert cache.load(list(range(64)), [2, 3, 4, 5]).wait() == 32
        assert cache.load(list(range(1000, 1064)), [2, 3, 4, 5]).wait() == 0
        assert torch.isnan(dst[0][:, [4, 5]]).all()
        with pytest.raises(Exception, match="block_ids span"):
            cache.load(list(range(32)), [0, PAGES])


def test_staging_ring_copies_runs_of_neighbouring_pages_and_lands_every_page():
    """Pages a little apart in host memory (an arena's slots) move in one copy per run; a page
    at an unaligned distance, or in another region, starts a run of its own; every page lands
    in its engine page, in a ring smaller than the lease."""
    import numpy as np

    from kvstore.client.staging import HostPages, StagingRing
    from kvstore.codecs.device import device_layout
    from kvstore.codecs.triton.engine import to_engine  # noqa: F401  (the ring's kernel)
    from kvstore.spec import EngineLayout

    dev = device_layout("raw", SPEC)
    blocks = [torch.randn(SPEC.block_shape).to(torch.bfloat16) for _ in range(7)]
    stride = dev.span + 512  # a slot's slack after each page
    first, second = torch.zeros(8 * stride, dtype=torch.uint8), torch.zeros(
        2 * stride, dtype=torch.uint8)
    starts = [0, stride, 2 * stride, 3 * stride + 100, 4 * stride + 100, 6 * stride + 100, 0]
    index = [0, 0, 0, 0, 0, 0, 1]
    for block, start, region in zip(blocks, starts, index):
        memory = (first, second)[region]
        memory[start:start + dev.span] = block.flatten().view(torch.uint8)
    pages = HostPages([first, second], np.array(index), np.array(starts, dtype=np.int64))
    ring = StagingRing(dev, torch.device(DEVICE), chunk_pages=4, slots=2)
    # joined: the 2nd and 3rd follow the 1st; the 4th is 100 bytes off; the 5th follows it;
    # the 6th is a slot further on (a gap under GAP_BYTES, aligned); the 7th is elsewhere.
    assert ring._runs(pages).tolist() == [False, True, True, False, True, True, False]
    dst = engine(poison=True)
    layout = EngineLayout.of(dst, SPEC)
    ids = [3, 9, 0, 11, 5, 7, 1]
    ring.load(layout, dev, pages, torch.tensor(ids))
    for block, page in zip(blocks, ids):
        got = torch.stack([torch.stack(layout.block_view(layer, page))
                           for layer in range(SPEC.num_layers)]).cpu()
        assert torch.equal(got, block)
    untouched = [p for p in range(PAGES) if p not in ids]
    assert all(torch.isnan(t[:, untouched]).all() for t in dst)


@pytest.mark.parametrize("tiers", ["hbm", "dram"])
def test_a_load_gives_its_lease_back_once_landed_without_a_wait(tmp_path, tiers):
    """The lease goes back from the cache's worker once the load's pages were read: an engine
    that never calls wait() holds no lease, and one that does never waits for the Release."""

    config = with_hbm(small_config(tmp_path)) if tiers == "hbm" else small_config(tmp_path)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(48))
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        EngineCache(client, ns, engine(poison=False)).save(tokens, [0, 1, 2])
        dst = engine(poison=True)
        cache = EngineCache(client, ns, dst)
        handle = cache.load(tokens, [5, 6, 7])
        assert handle.matched_tokens == 48
        assert wait_for(lambda: client.stats().active_leases == 0, interval_s=0.01)
        assert handle.wait() == 48  # still fine after the lease went back
        assert not torch.isnan(dst[0][:, [5, 6, 7]]).any()
        cache.close()


def test_a_prefix_over_two_devices_pools_saves_and_loads_across_them(tmp_path):
    """A tier on two devices whose preferred one holds three of five blocks: the save's slots
    spill onto the other device's pool, and a load reads both. On two GPUs the saving engine
    sits on the second (its pool is preferred) and the loading one on the first, so both the
    spilled writes and the reads cross GPUs through peer access; without two GPUs the tier's
    two host-memory devices run the same logic."""
    from kvstore.codecs.device import device_layout

    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() > 1
    if torch.cuda.is_available() and not two_gpus:
        pytest.skip("needs two GPUs (or none: the host-memory twin)")
    pair, saver_on, loader_on = (("cuda:0,cuda:1", "cuda:1", "cuda:0") if two_gpus
                                 else ("cpu:0,cpu:1", "cpu", "cpu"))
    slot = device_layout("raw", SPEC).nbytes
    config = dataclasses.replace(small_config(tmp_path), tiers=(
        TierConfig("gpu", "hbm", HbmConfig(capacity_bytes=3 * slot, device=pair)),
        TierConfig("host", "dram", DramConfig(capacity_bytes=8 * MiB, chunk_bytes=MiB)),
    ))
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(5 * 16))
    shape = (2, PAGES, SPEC.block_tokens, SPEC.num_kv_heads, SPEC.head_dim)
    src = [torch.randn(shape, device=saver_on).to(torch.bfloat16) for _ in range(3)]
    dst = [torch.full(shape, float("nan"), dtype=torch.bfloat16, device=loader_on)
           for _ in range(3)]
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        assert EngineCache(client, ns, src).save(tokens, [4, 0, 7, 1, 9]) == 80
        tier = daemon.store.tiers["gpu"]
        assert client.lookup(ns, tokens).tokens_per_tier == {"gpu": 80}
        assert tier.stats().extra["pools"] == 2
        with EngineCache(client, ns, dst) as loader:
            handle = loader.load(tokens, [2, 3, 5, 6, 8], advice=False)
            assert handle.wait() == 80 and handle.source == "device pool"
        assert all(torch.equal(x[:, [4, 0, 7, 1, 9]].cpu(), y[:, [2, 3, 5, 6, 8]].cpu())
                   for x, y in zip(src, dst))
        stats = client.stats()
        assert stats.active_leases == 0 and stats.active_reservations == 0


@pytest.mark.parametrize("tiers", ["hbm", "dram"])
def test_a_loads_release_rides_on_the_next_loads_acquire(tmp_path, tiers):
    """Loads one after another: each lease goes back on the next load's Acquire (no Release
    of its own); closing the cache sends and waits for the last one."""
    config = with_hbm(small_config(tmp_path)) if tiers == "hbm" else small_config(tmp_path)
    ns = Namespace(model_id="m", spec=SPEC, tenant="default")
    tokens = list(range(48))
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        client._late.LINGER_S = 30.0  # nothing but a carrying call or the close sends them
        EngineCache(client, ns, engine(poison=False)).save(tokens, [0, 1, 2])
        before = rpc_calls(daemon, "Release")
        with EngineCache(client, ns, engine(poison=True)) as loader:
            for pages in ([5, 6, 7], [8, 9, 10], [1, 2, 3]):
                assert loader.load(tokens, pages, advice=False).wait() == 48
                # the cache's worker hands the lease over once the load landed
                assert wait_for(lambda: client._late.is_pending, interval_s=0.01)
                assert client.stats().active_leases == 1  # the one before rode along
        assert rpc_calls(daemon, "Release") - before == 1  # the last load's, at the close
        assert client.stats().active_leases == 0
