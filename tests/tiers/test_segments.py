"""Segment I/O helpers of the SSD tier: the read-buffer pool and its lifetime rule."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import torch

from kvstore.config import SsdConfig
from kvstore.keys import BlockKey
from kvstore.page import PageMeta, encode_page
from kvstore.tiers.ssd.segments import ALIGN_BYTES, ReadBuffers, aligned
from kvstore.tiers.ssd.tier import SsdTier

MiB = 1 << 20


def address(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def test_buffers_are_aligned_and_reused_once_released() -> None:
    pool = ReadBuffers(max_bytes=MiB)
    buf = pool.take(3 * ALIGN_BYTES)
    first = address(buf)
    assert first % ALIGN_BYTES == 0 and len(buf) == 3 * ALIGN_BYTES and not buf.readonly
    del buf
    again = pool.take(2 * ALIGN_BYTES)  # a smaller read fits the same buffer
    assert address(again) == first and len(again) == 2 * ALIGN_BYTES
    assert pool.kept_bytes == 3 * ALIGN_BYTES


def test_a_buffer_is_not_lent_again_while_any_view_of_it_lives() -> None:
    """What a caller holds (a slice, a tensor made from it) must never change under it."""
    pool = ReadBuffers(max_bytes=MiB)
    buf = pool.take(ALIGN_BYTES)
    buf[:] = b"\x07" * ALIGN_BYTES
    held = [buf[100:200], torch.frombuffer(buf, dtype=torch.uint8)[:10]]
    first = address(buf)
    del buf
    for _ in range(3):
        other = pool.take(ALIGN_BYTES)
        assert address(other) != first
        other[:] = b"\xff" * ALIGN_BYTES
        assert bytes(held[0]) == b"\x07" * 100 and held[1].tolist() == [7] * 10
        del other
    held.pop(0)
    assert address(pool.take(ALIGN_BYTES)) != first  # the tensor still holds it
    held.clear()
    gc.collect()
    both = [pool.take(ALIGN_BYTES), pool.take(ALIGN_BYTES)]
    assert first in {address(b) for b in both} and pool.kept_bytes == 2 * ALIGN_BYTES


def test_kept_bytes_stay_within_the_bound() -> None:
    pool = ReadBuffers(max_bytes=4 * ALIGN_BYTES)
    lent = [pool.take(2 * ALIGN_BYTES) for _ in range(3)]  # the third is a one-off
    assert len({address(b) for b in lent}) == 3 and pool.kept_bytes == 4 * ALIGN_BYTES
    lent.clear()
    big = pool.take(3 * ALIGN_BYTES)  # free buffers too small for it make way
    assert pool.kept_bytes == 3 * ALIGN_BYTES and address(big) % ALIGN_BYTES == 0


def _page(i: int, payload_bytes: int) -> tuple[BlockKey, PageMeta, bytes]:
    key = BlockKey(i.to_bytes(4, "little") * 4)
    meta = PageMeta(key=key, namespace=b"n" * 16, parent=None, block_index=i, tenant="t",
                    model_id="m", codec="raw", codec_id=1)
    payload = np.random.default_rng(i).integers(0, 256, payload_bytes, dtype=np.uint8)
    return key, meta, encode_page(meta, payload.tobytes())


async def test_a_page_kept_by_its_reader_survives_later_reads(tmp_path) -> None:
    """SSD reads reuse their buffers: a page someone still holds (compaction keeps one until
    its copy is written) must not be overwritten by the reads after it."""
    tier = SsdTier(SsdConfig(path=str(tmp_path / "ssd"), capacity_bytes=64 * MiB,
                             segment_bytes=4 * MiB, fsync="never"))
    await tier.open()
    try:
        pages = [_page(i, 200_000) for i in range(8)]
        for key, meta, data in pages:
            assert await tier.write(key, data, meta)
        kept = await tier.read(pages[0][0])
        payload = torch.frombuffer(kept.payload, dtype=torch.uint8)
        for _ in range(3):
            got = await asyncio.gather(*(tier.read(k, verify=False) for k, _, _ in pages[1:]))
            assert [bytes(p.data) for p in got] == [d for _, _, d in pages[1:]]
            del got
        assert bytes(kept.data) == pages[0][2]
        assert bytes(payload.numpy()) == bytes(kept.payload)
        # 22 reads, at most 8 pages alive at once: buffers were reused, not one made per read.
        assert 0 < tier.stats().extra["read_buffer_bytes"] <= 12 * aligned(len(pages[0][2]))
    finally:
        await tier.close()
