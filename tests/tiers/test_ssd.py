"""SsdTier on real files: round trips, restart, corruption, crashes, capacity, admission."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from kvstore.config import SsdConfig
from kvstore.errors import AlreadyRunning, InvalidArgument, Unavailable
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, encode_page
from kvstore.tiers.ssd.segments import ALIGN_BYTES
from kvstore.tiers.ssd.tier import SsdTier
from tests.tiers.ssd_crash_writer import crash_page

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def make_page(i: int, payload_bytes: int, seed: int = 0) -> tuple[BlockKey, PageMeta, bytes]:
    rng = random.Random(seed * 1_000_003 + i)
    key = BlockKey(rng.randbytes(16))
    meta = PageMeta(key=key, namespace=b"namespace-fprint", parent=BlockKey(rng.randbytes(16)),
                    block_index=i, tenant="acme", model_id="test/model", codec="raw",
                    codec_id=1)
    return key, meta, encode_page(meta, rng.randbytes(payload_bytes))


def config(path: Path, **overrides) -> SsdConfig:
    fields = {"path": str(path), "capacity_bytes": 64 * MiB, "segment_bytes": MiB,
              "fsync": "never", "fsync_interval_s": 0.01}
    fields.update(overrides)
    return SsdConfig(**fields)


async def opened(cfg: SsdConfig) -> SsdTier:
    tier = SsdTier(cfg)
    await tier.open()
    return tier


def segment_files(path: Path) -> list[Path]:
    return sorted(path.glob("seg-*.dat"))


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in segment_files(path))


@pytest.fixture
async def tier(tmp_path):
    t = await opened(config(tmp_path / "ssd"))
    yield t
    await t.close()


async def test_round_trip(tier):
    key, meta, data = make_page(0, 5000)
    assert not tier.contains(key)
    assert await tier.write(key, data, meta)
    assert tier.contains(key)
    page = await tier.read(key)
    assert page is not None and bytes(page.data) == data and page.meta == meta
    assert await tier.write(key, data, meta)  # present: a no-op
    assert tier.stats().num_blocks == 1
    assert await tier.delete(key) and not await tier.delete(key)
    assert not tier.contains(key) and await tier.read(key) is None
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.num_blocks) == (1, 1, 0)


async def test_many_pages_of_several_sizes(tier):
    sizes = [0, 1, 100, ALIGN_BYTES - 150, ALIGN_BYTES, 10_000, 300_000, 1_500_000]
    pages = [make_page(i, size) for i, size in enumerate(sizes * 3)]
    assert all(await asyncio.gather(*(tier.write(k, d, m) for k, m, d in pages)))
    for key, meta, data in pages:
        page = await tier.read(key)
        assert bytes(page.data) == data and page.meta == meta
    assert await tier.read(BlockKey(b"\x01" * 16)) is None
    stats = tier.stats()
    assert stats.num_blocks == len(pages) and stats.misses == 1 and stats.hits == len(pages)
    assert stats.used_bytes == disk_bytes(Path(tier._config.path))


async def test_rejects_pages_that_do_not_match_their_key(tier):
    key, meta, data = make_page(0, 100)
    other, other_meta, _ = make_page(1, 100)
    with pytest.raises(InvalidArgument, match="does not verify"):
        await tier.write(other, data, other_meta)
    with pytest.raises(InvalidArgument, match="does not verify"):
        await tier.write(key, data[:-1], meta)
    with pytest.raises(InvalidArgument, match="meta is for key"):
        await tier.write(key, data, other_meta)
    assert tier.stats().num_blocks == 0


async def test_restart_serves_every_block_again(tmp_path):
    cfg = config(tmp_path / "ssd")
    pages = [make_page(i, 1000 + 37 * i) for i in range(200)]
    tier = await opened(cfg)
    assert all(await asyncio.gather(*(tier.write(k, d, m) for k, m, d in pages)))
    await tier.delete(pages[0][0])
    used = tier.used_bytes
    await tier.close()
    with pytest.raises(Unavailable):
        await tier.read(pages[1][0])

    tier = await opened(cfg)
    try:
        assert tier.used_bytes == used == disk_bytes(tmp_path / "ssd")
        assert {m.key: m for m in tier.entries()} == {m.key: m for _, m, _ in pages[1:]}
        assert await tier.read(pages[0][0]) is None
        for key, meta, data in pages[1:]:
            assert bytes((await tier.read(key)).data) == data
        assert tier.stats().extra["dead_bytes"] > 0  # the deleted page, rebuilt from the index
    finally:
        await tier.close()


async def test_directory_is_locked_while_open(tier):
    with pytest.raises(AlreadyRunning):
        await opened(tier._config)


def flip_payload_bytes(directory: Path, data: bytes) -> None:
    """Damage the stored copy of ``data`` (found by content) in the middle of its payload."""
    for seg in segment_files(directory):
        blob = seg.read_bytes()
        at = blob.find(data)
        if at >= 0:
            fd = os.open(seg, os.O_WRONLY)
            try:
                middle = at + len(data) - 100
                os.pwrite(fd, bytes(b ^ 0xFF for b in blob[middle:middle + 8]), middle)
                os.fsync(fd)
            finally:
                os.close(fd)
            return
    raise AssertionError("page not found in any segment")


async def test_corrupt_page_is_dropped_never_served(tmp_path, caplog):
    cfg = config(tmp_path / "ssd")
    pages = [make_page(i, 20_000) for i in range(3)]
    tier = await opened(cfg)
    try:
        for key, meta, data in pages:
            assert await tier.write(key, data, meta)
        flip_payload_bytes(tmp_path / "ssd", pages[1][2])
        assert await tier.read(pages[1][0]) is None
        assert tier.stats().corrupt == 1 and not tier.contains(pages[1][0])
        assert "failed verification" in caplog.text
        assert await tier.read(pages[1][0]) is None  # now a plain miss
        stats = tier.stats()
        assert stats.corrupt == 1 and stats.misses == 2
        for key, meta, data in (pages[0], pages[2]):
            assert bytes((await tier.read(key)).data) == data
    finally:
        await tier.close()
    tier = await opened(cfg)  # the drop reached the index
    try:
        assert not tier.contains(pages[1][0]) and tier.stats().num_blocks == 2
    finally:
        await tier.close()


@pytest.mark.parametrize("fsync", ["always", "batch"])
async def test_sigkill_loses_no_acknowledged_page(tmp_path, fsync):
    directory = tmp_path / "ssd"
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "tests" / "tiers" / "ssd_crash_writer.py"), str(directory),
        fsync, stdout=asyncio.subprocess.PIPE, cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    acknowledged = []
    try:
        while len(acknowledged) < 150:
            line = await asyncio.wait_for(child.stdout.readline(), timeout=60)
            if not line:
                break  # the writer died on its own: the assert below reports it
            acknowledged.append(int(line))
    finally:
        child.send_signal(signal.SIGKILL)
        rest, _ = await child.communicate()
    assert len(acknowledged) >= 150, "the writer died before the kill"
    acknowledged += [int(line) for line in rest.split()]  # printed before the kill landed

    tier = await opened(config(directory))
    try:
        for i in acknowledged:
            key, meta, data = crash_page(i)
            page = await tier.read(key)
            assert page is not None and bytes(page.data) == data, f"page {i} lost"
        for meta in list(tier.entries()):  # pages indexed but not yet acknowledged verify too
            assert await tier.read(meta.key) is not None
        assert tier.stats().corrupt == 0
    finally:
        await tier.close()


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def test_torn_tail_and_short_segment_are_tolerated(tmp_path):
    directory = tmp_path / "ssd"
    cfg = config(directory)
    pages = [make_page(i, 50_000) for i in range(10)]
    tier = await opened(cfg)
    for key, meta, data in pages:
        assert await tier.write(key, data, meta)
    await tier.close()
    active = segment_files(directory)[-1]
    size = active.stat().st_size
    append_bytes(active, b"\xde\xad" * 3000)  # a torn append that was never indexed

    tier = await opened(cfg)
    try:
        assert active.stat().st_size == size  # truncated back to the last indexed page
        assert all([await tier.read(k) is not None for k, _, _ in pages])
        extra = make_page(99, 1000)
        assert await tier.write(extra[0], extra[2], extra[1])
    finally:
        await tier.close()
    os.truncate(active, size - ALIGN_BYTES)  # the last page of that segment is now cut short

    tier = await opened(cfg)
    try:
        readable = [k for k, _, _ in pages + [extra] if await tier.read(k) is not None]
        assert len(readable) == len(pages)  # exactly one page was lost, none served damaged
        assert tier.stats().corrupt == 0 and tier.contains(extra[0])
    finally:
        await tier.close()


async def test_capacity_is_never_exceeded_and_compaction_reclaims(tmp_path):
    directory = tmp_path / "ssd"
    capacity = 4 * MiB
    tier = await opened(config(directory, capacity_bytes=capacity))
    rng = random.Random(7)
    live: dict[BlockKey, bytes] = {}
    segment_names: set[str] = set()
    try:
        for i in range(2500):
            key, meta, data = make_page(i, rng.randrange(100, 12_000), seed=3)
            while not await tier.write(key, data, meta):
                victim = rng.choice(list(live))  # what the store does: evict, then retry
                assert await tier.delete(victim)
                del live[victim]
            live[key] = data
            if rng.random() < 0.3:
                victim = rng.choice(list(live))
                await tier.delete(victim)
                del live[victim]
            assert disk_bytes(directory) <= capacity and tier.used_bytes <= capacity
            segment_names.update(p.name for p in segment_files(directory))
        stats = tier.stats()
        assert stats.extra["compactions"] > 0
        assert len(segment_names) > capacity // MiB + 2  # segments were deleted and replaced
        assert stats.num_blocks == len(live) and stats.used_bytes == disk_bytes(directory)
        for key, data in live.items():
            assert bytes((await tier.read(key)).data) == data
    finally:
        await tier.close()


async def test_empty_segment_is_deleted_at_once(tier):
    directory = Path(tier._config.path)
    pages = [make_page(i, 200_000) for i in range(12)]  # about 2.4 segments
    for key, meta, data in pages:
        assert await tier.write(key, data, meta)
    first = segment_files(directory)[0]
    first_size, used = first.stat().st_size, tier.used_bytes
    in_first = [k for k, _, d in pages if d in first.read_bytes()]
    for key in in_first[:-1]:
        await tier.delete(key)
    assert first.exists() and tier.stats().extra["dead_bytes"] > 0
    await tier.delete(in_first[-1])
    assert not first.exists() and tier.used_bytes == used - first_size


async def test_can_write_tracks_capacity(tmp_path):
    tier = await opened(config(tmp_path / "ssd", capacity_bytes=2 * MiB,
                               compact_dead_fraction=1.0))
    try:
        assert tier.can_write(2 * MiB) and not tier.can_write(2 * MiB + 1)
        key, meta, data = make_page(0, MiB)
        assert await tier.write(key, data, meta)
        assert not tier.can_write(MiB) and tier.can_write(MiB // 2)
        too_big = make_page(1, MiB)
        assert not await tier.write(too_big[0], too_big[2], too_big[1])
        assert tier.stats().rejected == 1
    finally:
        await tier.close()


def o_direct_works(directory: Path) -> bool:
    import mmap

    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, mmap.mmap(-1, 4096))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
async def test_buffered_fallback_on_tmpfs():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        cfg = config(Path(shm) / "ssd")
        pages = [make_page(i, 3000 * i + 1) for i in range(20)]
        tier = await opened(cfg)
        try:
            assert tier.stats().extra["o_direct"] == int(o_direct_works(Path(shm)))
            assert all(await asyncio.gather(*(tier.write(k, d, m)
                                              for k, m, d in pages)))
        finally:
            await tier.close()
        tier = await opened(cfg)
        try:
            for key, meta, data in pages:
                assert bytes((await tier.read(key)).data) == data
        finally:
            await tier.close()


async def test_o_direct_is_reported(tmp_path):
    for wanted in (True, False):
        tier = await opened(config(tmp_path / f"ssd-{wanted}", o_direct=wanted))
        try:
            expected = wanted and o_direct_works(tmp_path)
            assert tier.o_direct == expected and tier.stats().extra["o_direct"] == int(expected)
            key, meta, data = make_page(0, 7000)
            assert await tier.write(key, data, meta)
            assert bytes((await tier.read(key)).data) == data
        finally:
            await tier.close()


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
async def test_concurrent_writes_and_reads_are_consistent(tmp_path, fsync):
    tier = await opened(config(tmp_path / "ssd", fsync=fsync))
    try:
        pages = [make_page(i, 500 + 911 * i) for i in range(100)]
        duplicate = pages[:10]  # written twice at once: stored once
        results = await asyncio.gather(
            *(tier.write(k, d, m) for k, m, d in pages + duplicate))
        assert all(results) and tier.stats().num_blocks == 100
        assert tier.stats().extra["appends"] < 50  # queued pages were combined into appends
        more = [make_page(i, 4000, seed=1) for i in range(100)]
        reads, writes = await asyncio.gather(
            asyncio.gather(*(tier.read(k) for k, _, _ in pages)),
            asyncio.gather(*(tier.write(k, d, m) for k, m, d in more)))
        assert all(writes)
        assert [bytes(p.data) for p in reads] == [d for _, _, d in pages]
        again = await asyncio.gather(*(tier.read(k) for k, _, _ in pages + more))
        assert [bytes(p.data) for p in again] == [d for _, _, d in pages + more]
        assert tier.used_bytes == disk_bytes(tmp_path / "ssd")
    finally:
        await tier.close()


async def test_delete_during_write_then_rewrite(tmp_path):
    """A delete that raced a queued write once left a rewrite waiting on the cancelled one."""
    tier = await opened(config(tmp_path / "ssd", fsync="batch", fsync_interval_s=0.05))
    try:
        key, meta, data = make_page(0, 3000)
        first = asyncio.create_task(tier.write(key, data, meta))
        await asyncio.sleep(0)
        assert await tier.delete(key)
        assert await first and not tier.contains(key)
        assert await tier.write(key, data, meta) and tier.contains(key)
        assert bytes((await tier.read(key)).data) == data
    finally:
        await tier.close()


async def test_close_completes_writes_in_flight(tmp_path):
    cfg = config(tmp_path / "ssd", fsync="batch", fsync_interval_s=10.0)
    pages = [make_page(i, 20_000) for i in range(40)]
    tier = await opened(cfg)
    writes = [asyncio.create_task(tier.write(k, d, m)) for k, m, d in pages]
    await asyncio.sleep(0)  # queued, none appended yet
    await tier.close()
    assert all(w.result() for w in writes)
    tier = await opened(cfg)
    try:
        assert tier.stats().num_blocks == len(pages)
    finally:
        await tier.close()
