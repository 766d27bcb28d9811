"""A full SsdTier: room-making and reclaim find the deadest segment through an ordered
structure (``DeadOrder``) instead of walking every segment; segment descriptors are a bounded
cache (``SegmentFiles``); every page stays readable."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from kvstore.config import SsdConfig
from kvstore.errors import ConfigError
from kvstore.tiers.ssd.segments import DeadOrder, Segment
from tests.tiers.test_ssd import config, make_page, opened

KiB = 1 << 10


def test_dead_order_matches_a_walk_over_every_segment():
    rng = random.Random(7)
    order = DeadOrder()
    segments = {}
    for step in range(4000):
        action = rng.random()
        if action < 0.1 or not segments:  # a new segment
            seg = Segment(step, Path(f"seg-{step}"), size_bytes=rng.randrange(1, 65) * 4096)
            seg.live_bytes = seg.size_bytes
            segments[seg.segment_id] = seg
            order.note(seg)
        elif action < 0.15:  # removed
            seg = segments.pop(rng.choice(list(segments)))
            seg.is_removed = True
            order.note(seg) if rng.random() < 0.5 else order.discard(seg)
        else:  # a page of it died
            seg = segments[rng.choice(list(segments))]
            seg.live_bytes -= min(seg.live_bytes, 4096 * rng.randrange(1, 4))
            order.note(seg)
        busy = {i for i in segments if rng.random() < 0.2}
        accept = (lambda s: s.segment_id not in busy)  # noqa: B023 - used at once
        expected = min((s for s in segments.values() if accept(s)),
                       key=lambda s: (-s.dead_bytes, s.segment_id), default=None)
        assert order.first(accept) is expected, step
        assert len(order) == len(segments)


async def test_full_tier_asks_room_of_its_deadest_segment_and_keeps_every_page(tmp_path):
    # 4 KiB pages, 16 to a 64 KiB segment, 40 segments of room: fill it, then keep putting,
    # deleting as the store does: what room_for asks, from the segment it names.
    tier = await opened(config(tmp_path / "ssd", capacity_bytes=40 * 64 * KiB,
                               segment_bytes=64 * KiB, o_direct=False, max_open_segments=8))
    rng = random.Random(3)
    stored = {}
    try:
        for i in range(2000):
            key, meta, page = make_page(i, 3000)
            while (need := tier.room_for(len(page))) is not None:
                assert need.size_class is not None, "the sealed segments hold pages"
                in_class = [k for k in stored if tier.footprint(k).size_class == need.size_class]
                assert in_class, f"room_for named segment {need.size_class} with no live page"
                deadest = max(s.dead_bytes for s in tier._segments.values()
                              if tier._is_idle_sealed(s))
                assert tier._segments[need.size_class].dead_bytes == deadest
                freed = 0
                while freed < need.nbytes and in_class:
                    victim = in_class.pop(rng.randrange(len(in_class)))
                    freed += tier.footprint(victim).nbytes
                    assert await tier.delete(victim)
                    del stored[victim]
                if rng.random() < 0.3 and stored:  # other deletions: segments of every deadness
                    victim = rng.choice(list(stored))
                    assert await tier.delete(victim)
                    del stored[victim]
            assert await tier.write(key, page, meta), i
            stored[key] = page
            assert tier.used_bytes <= tier.capacity_bytes
        assert tier.stats().extra["compactions"] > 0
        assert len(tier._segments) > 20
        for key, page in stored.items():
            got = await tier.read(key)
            assert got is not None and bytes(got.data) == page
    finally:
        await tier.close()


def open_segment_fds(directory: Path) -> int:
    """Descriptors of this process open on segment files in ``directory``."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith(str(directory)) and Path(target).name.startswith("seg-")
    return count


async def fill_segments(tier, pages: int) -> dict:
    stored = {}
    for i in range(pages):
        key, meta, page = make_page(i, 3000, seed=5)
        assert await tier.write(key, page, meta)
        stored[key] = page
    return stored


@pytest.mark.parametrize("concurrent", [False, True])
async def test_reads_from_more_segments_than_descriptors_kept_are_bit_exact(tmp_path,
                                                                             concurrent):
    # 320 pages of 4 KiB in 64 KiB segments: 20 segments, 3 descriptors kept. Read all of
    # them in random order, one at a time (each read reopens what the last evicted) or all at
    # once (every read holds its descriptor while 19 other segments are opened past the bound:
    # closing one in use would fail its read and drop the page).
    path = tmp_path / "ssd"
    tier = await opened(config(path, segment_bytes=64 * KiB, o_direct=False,
                               max_open_segments=3))
    try:
        stored = await fill_segments(tier, 320)
        assert tier.stats().extra["segments"] == 20
        assert open_segment_fds(path) <= 3
        keys = list(stored)
        random.Random(1).shuffle(keys)
        opens = tier._files.opens
        if concurrent:
            pages = await asyncio.gather(*(tier.read(k) for k in keys))
        else:
            pages = [await tier.read(k) for k in keys]
        for key, page in zip(keys, pages, strict=True):
            assert page is not None and bytes(page.data) == stored[key]
        assert tier.stats().corrupt == 0
        assert tier._files.opens > opens + 3, "the reads reopened evicted descriptors"
        assert tier._files.num_open <= 3
        assert open_segment_fds(path) <= 3
    finally:
        await tier.close()
    assert open_segment_fds(path) == 0


async def test_reopened_tier_opens_at_most_the_bound_and_serves_every_page(tmp_path):
    path = tmp_path / "ssd"
    cfg = config(path, segment_bytes=64 * KiB, o_direct=False, max_open_segments=2)
    tier = await opened(cfg)
    stored = await fill_segments(tier, 160)
    await tier.close()
    tier = await opened(cfg)
    try:
        assert open_segment_fds(path) <= 2
        for key, page in stored.items():
            got = await tier.read(key)
            assert got is not None and bytes(got.data) == page
        assert open_segment_fds(path) <= 2
    finally:
        await tier.close()


def test_max_open_segments_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="ssd.max_open_segments must be >= 1, got 0"):
        SsdConfig(path=str(tmp_path), max_open_segments=0)
