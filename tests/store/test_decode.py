"""Get-side decoding (kvstore/store/decode.py): every page verified where it is decoded."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from kvstore import codecs
from kvstore.errors import CodecError
from kvstore.page import PageMeta, encode_page, parse_page
from kvstore.spec import KVSpec
from kvstore.store import decode
from kvstore.store.decode import PageDecoder, decode_pages

from ..conftest import random_kv

# 4 blocks of 4 KiB are verified and decoded on the loop, 4 of 256 KiB on the decode threads.
SMALL = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16, dtype="bfloat16")
BIG = KVSpec(num_layers=8, num_kv_heads=8, head_dim=64, block_tokens=16, dtype="bfloat16")


def pages_of(kv: torch.Tensor, codec_name: str, damaged: tuple[int, ...] = ()) -> list:
    codec = codecs.get(codec_name)
    pages = []
    for i in range(kv.shape[2] // 16):
        meta = PageMeta(key=bytes([i]) * 16, namespace=bytes(16), parent=None, block_index=i,
                        tenant="t", model_id="m", codec=codec.name, codec_id=codec.codec_id)
        data = bytearray(encode_page(meta, codec.encode(kv[:, :, 16 * i:16 * (i + 1)])))
        if i in damaged:
            data[-20] ^= 0x01
        pages.append(parse_page(data))
    return pages


@pytest.mark.parametrize("spec", [SMALL, BIG], ids=["inline", "threads"])
@pytest.mark.parametrize("codec_name", ["raw", "fp8_e4m3"])
async def test_every_page_is_verified_and_failures_are_named(spec, codec_name):
    kv = random_kv(spec, 64)
    pages = pages_of(kv, codec_name, damaged=(1, 2))
    out = torch.zeros_like(kv)
    outs = list(out.split(16, dim=2))
    assert await decode_pages(pages, outs) == [1, 2]
    expect = codecs.decode(pages_of(kv, codec_name)[0].payload)
    assert torch.equal(outs[0], expect)
    assert torch.equal(outs[3], codecs.decode(pages_of(kv, codec_name)[3].payload))
    assert await decode_pages(pages_of(kv, codec_name), outs) == []


async def test_decode_threads_share_the_cores_for_torch():
    """Decode threads are the parallelism: a full OpenMP team per decode thread oversubscribed
    the cores. The limit is per thread: the caller's own torch thread count is untouched."""
    before = torch.get_num_threads()
    loop = asyncio.get_running_loop()
    in_worker = await loop.run_in_executor(decode._decode_executor(), torch.get_num_threads)
    assert torch.get_num_threads() == before
    if decode._openmp_runtimes():
        assert in_worker == decode.OPENMP_THREADS_PER_DECODE_THREAD
        assert in_worker * decode.DECODE_THREADS <= max(os.cpu_count() or 1, decode.DECODE_THREADS)
    else:  # no OpenMP runtime in this build: torch runs its own pool, nothing to limit
        assert in_worker == before


@pytest.mark.parametrize("spec", [SMALL, BIG], ids=["inline", "threads"])
async def test_pages_added_as_they_arrive_in_any_order(spec):
    kv = random_kv(spec, 16 * 6, seed=3)
    pages = pages_of(kv, "raw", damaged=(4, 0))
    out = torch.zeros_like(kv)
    async with PageDecoder(list(out.split(16, dim=2))) as decoder:
        for i in (5, 0, 3, 4, 1):  # block 2 never arrives (a miss)
            decoder.add(i, pages[i])
            await asyncio.sleep(0)
    assert decoder.failed == [0, 4]
    for i in (1, 3, 5):
        assert torch.equal(out[:, :, 16 * i:16 * (i + 1)], kv[:, :, 16 * i:16 * (i + 1)])
    assert not out[:, :, 32:48].any()  # nothing was written for the block that never came


async def test_a_decode_error_surfaces_after_every_thread_stopped():
    """A page that verifies but holds no valid blob raises the codec's error, once the other
    pages' threads are done with them (the store unpins the blocks right after)."""
    kv = random_kv(BIG, 64)
    pages = pages_of(kv, "raw")
    meta = pages[2].meta
    pages[2] = parse_page(encode_page(meta, b"not a codec blob" * 100))
    out = torch.zeros_like(kv)
    decoder = PageDecoder(list(out.split(16, dim=2)))
    with pytest.raises(CodecError):
        async with decoder:
            for i, page in enumerate(pages):
                decoder.add(i, page)
    assert decoder._num_running == 0


async def test_trusted_raw_pages_of_a_block_are_copied_on_the_loop(monkeypatch):
    """A trusted raw page (published memory: nothing to verify) of one 2 MiB block is a copy,
    done on the loop with no thread hop; the same page untrusted goes to a decode thread to
    be verified there; either lands bit-exact in its (strided) output view."""
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
    kv = random_kv(spec, 32)
    hops = []
    real = decode._decode_executor
    monkeypatch.setattr(decode, "_decode_executor", lambda: hops.append(1) or real())
    for trusted, expect_hops in ((True, 0), (False, 1)):
        hops.clear()
        pages = pages_of(kv, "raw")
        pages = [parse_page(page.data, is_trusted=trusted) for page in pages]
        out = torch.zeros_like(kv)
        outs = list(out.split(16, dim=2))
        async with PageDecoder(outs) as decoder:
            decoder.add(1, pages[1])
        assert decoder.failed == [] and len(hops) == expect_hops
        assert torch.equal(outs[1], kv[:, :, 16:32]) and not outs[0].any()
