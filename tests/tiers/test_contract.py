"""The Tier contract (kvstore/tiers/base.py), run against every tier implementation."""

from __future__ import annotations

import asyncio
import mmap
import os
from pathlib import Path

import pytest

from kvstore.config import DramConfig, RemoteConfig, SsdConfig
from kvstore.errors import CorruptPage
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, encode_page, verify_page
from kvstore.store.placement import MAX_ROOM_ROUNDS
from kvstore.tiers.base import Tier
from kvstore.tiers.dram.tier import DramTier
from kvstore.tiers.remote.tier import RemoteTier
from kvstore.tiers.ssd.tier import SsdTier

MiB = 1 << 20
CAPACITY = 4 * MiB


def make_page(i: int, payload_bytes: int) -> tuple[BlockKey, PageMeta, bytes]:
    key = BlockKey(i.to_bytes(4, "little") * 4)
    meta = PageMeta(key=key, namespace=b"n" * 16, parent=None, block_index=i, tenant="t",
                    model_id="m", codec="raw", codec_id=1)
    return key, meta, encode_page(meta, os.urandom(payload_bytes))


@pytest.fixture(params=["dram", "ssd", "remote"])
async def tier(request, tmp_path):
    if request.param == "dram":
        t: Tier = DramTier(DramConfig(capacity_bytes=CAPACITY, chunk_bytes=1 * MiB))
    elif request.param == "remote":  # skipped when no redis-server exists (tests/redis_servers)
        t = RemoteTier(RemoteConfig(url=request.getfixturevalue("redis_url"),
                                    key_prefix=request.getfixturevalue("key_prefix"),
                                    capacity_bytes=CAPACITY, directory=False))
    else:
        t = SsdTier(SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=CAPACITY,
                              segment_bytes=1 * MiB, fsync="never"))
    await t.open()
    yield t
    await t.close()


async def test_write_read_delete(tier):
    key, meta, data = make_page(1, 10_000)
    assert not tier.contains(key) and await tier.read(key) is None
    assert await tier.write(key, data, meta)
    assert tier.contains(key) and tier.page_size(key) == len(data)
    page = await tier.read(key)
    assert bytes(page.data) == data and page.meta.key == key
    assert await tier.write(key, data, meta)  # rewriting a present key is a no-op
    assert [m.key for m in tier.entries()] == [key]
    assert await tier.delete(key) and not tier.contains(key)
    assert not await tier.delete(key)
    assert await tier.read(key) is None and tier.page_size(key) is None


async def test_stats_count_what_happened(tier):
    pages = [make_page(i, 5_000 + 1000 * i) for i in range(5)]
    for key, meta, data in pages:
        await tier.write(key, data, meta)
    for key, _, _ in pages[:3]:
        await tier.read(key)
    await tier.read(BlockKey(b"x" * 16))
    s = tier.stats()
    assert (s.num_blocks, s.hits, s.misses) == (5, 3, 1)
    assert s.capacity_bytes == CAPACITY
    assert s.bytes_written >= sum(len(d) for _, _, d in pages)
    assert s.bytes_read >= sum(len(d) for _, _, d in pages[:3])
    assert 0 < s.used_bytes <= CAPACITY
    assert set(s.as_dict()) >= {"capacity_bytes", "used_bytes", "num_blocks", "hits", "misses",
                                "evictions", "corrupt", "bytes_read", "bytes_written"}


async def test_capacity_is_a_hard_bound(tier):
    """Writing until refused, then evicting oldest-first like the store, never passes capacity."""
    live: list[BlockKey] = []
    for i in range(400):
        key, meta, data = make_page(i, 60_000)
        while not await tier.write(key, data, meta):
            assert live, "an empty tier must accept a page far below capacity"
            await tier.delete(live.pop(0))
        live.append(key)
        assert tier.used_bytes <= tier.capacity_bytes
    assert not tier.can_write(CAPACITY * 2)
    for key in live[-5:]:
        assert (await tier.read(key)).meta.key == key


async def test_concurrent_writers_and_readers(tier):
    pages = [make_page(i, 3_000) for i in range(60)]
    await asyncio.gather(*(tier.write(k, d, m) for k, m, d in pages))
    pages_read = await asyncio.gather(*(tier.read(k) for k, _, _ in pages))
    assert [bytes(p.data) for p in pages_read] == [d for _, _, d in pages]


def _stored_at(tier: Tier, key: BlockKey, data: bytes) -> tuple[Path, int]:
    """The file holding the stored copy of ``data`` and its offset there."""
    if isinstance(tier, DramTier):
        region, offset, _ = tier.locate(key)
        return Path(tier.region_path(region)), offset
    for seg in sorted(Path(tier._config.path).glob("seg-*.dat")):
        at = seg.read_bytes().find(data)
        if at >= 0:
            return seg, at
    raise AssertionError(f"page {key.hex()} not found in a segment")


def _damage(tier: Tier, key: BlockKey, data: bytes) -> None:
    """Flip 8 payload bytes of the stored copy of ``data``, behind the tier's back."""
    if isinstance(tier, RemoteTier):  # SETRANGE inside Redis
        import redis

        with redis.Redis.from_url(tier._config.url) as client:
            name = tier.page_key(key, "t")
            at = len(data) - 100
            client.setrange(name, at, bytes(b ^ 0xFF for b in data[at:at + 8]))
        return
    path, offset = _stored_at(tier, key, data)
    at = offset + len(data) - 100
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[at:at + 8] = bytes(b ^ 0xFF for b in m[at:at + 8])
        m.flush()  # SSD reads go around the page cache (O_DIRECT)


async def test_unverified_read_leaves_the_checksum_to_the_caller(tier):
    """read(verify=False) parses without checking the sum: verify_page is the caller's check,
    and a verified re-read is what removes and counts a damaged page. A tier whose pages
    nobody else can write (DRAM's published memory) returns them trusted, and the damage is
    refused instead."""
    key, meta, data = make_page(7, 50_000)
    other_key, other_meta, other = make_page(8, 50_000)
    for k, m, d in ((key, meta, data), (other_key, other_meta, other)):
        assert await tier.write(k, d, m)
    page = await tier.read(key, verify=False)
    assert bytes(page.data) == data and page.meta == meta
    verify_page(page)
    del page
    if isinstance(tier, DramTier):
        with pytest.raises(PermissionError):
            await asyncio.to_thread(_damage, tier, key, data)
        page = await tier.read(key, verify=False)
        assert page.is_trusted and bytes(page.data) == data
        return
    await asyncio.to_thread(_damage, tier, key, data)
    page = await tier.read(key, verify=False)
    with pytest.raises(CorruptPage, match="checksum mismatch"):
        verify_page(page)
    assert tier.contains(key) and tier.stats().corrupt == 0  # the caller does not judge
    del page
    assert await tier.read(key) is None
    assert not tier.contains(key) and tier.stats().corrupt == 1
    assert await tier.read(key, verify=False) is None  # gone: a plain miss
    verify_page(await tier.read(other_key, verify=False))


async def test_room_is_what_the_tier_says_it_needs(tier):
    """room_for agrees with can_write; deleting what it asks for, the way the store picks
    victims (footprints of its size class whose charges add up to ``need.nbytes``, oldest first),
    lets the page in within the store's rounds of making room; footprints exist for stored keys
    only; a page over ``max_page_bytes`` never fits, even in an empty tier."""
    live: list[BlockKey] = []
    for i in range(400):
        key, meta, data = make_page(i, 60_000)
        if not await tier.write(key, data, meta):
            break
        assert tier.footprint(key).nbytes >= len(data)
        live.append(key)
    key, meta, data = make_page(999, 60_000)
    need = tier.room_for(len(data))
    assert need is not None and not tier.can_write(len(data))
    for _ in range(MAX_ROOM_ROUNDS):
        need = tier.room_for(len(data))
        if need is not None:
            freed = 0
            for victim in [k for k in live if need.size_class in (None, tier.footprint(k).size_class)]:
                if freed >= need.nbytes:
                    break
                freed += tier.footprint(victim).nbytes
                assert await tier.delete(victim)
                live.remove(victim)
            assert freed >= need.nbytes
        if await tier.write(key, data, meta):
            break
    assert tier.contains(key) and tier.footprint(BlockKey(b"z" * 16)) is None
    for victim in live:
        await tier.delete(victim)
    assert tier.room_for(tier.max_page_bytes + 1) is not None
    assert tier.max_page_bytes <= tier.capacity_bytes
