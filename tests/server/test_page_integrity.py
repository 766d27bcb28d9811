"""Pages a client could tamper with: forged pages in its own arena are never served (seals),
and Commit refuses pages that would not decode."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kvstore import codecs
from kvstore.client import NO_RETRY, AsyncClient
from kvstore.client.arena import ArenaMaps
from kvstore.errors import CorruptPage
from kvstore.page import PageMeta, decode_page, encode_page
from kvstore.rpc.fdpass import fd_socket_path
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import small_config

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}


def _forge(channel: str, location, kv: torch.Tensor) -> None:
    """Replace a stored page in the tenant's own arena with a well-formed page of the same key
    holding ``kv``, its plain checksum recomputed: what a client with the arena mapped can
    do."""
    maps = ArenaMaps(token=TOKENS["acme"], channel=channel)
    try:
        slot = maps.view(location.region, location.offset, location.length, writable=True)
        meta = decode_page(slot, expected_key=location.key).meta
        forged = encode_page(meta, codecs.get("raw").encode(kv))
        assert len(forged) == location.length
        slot[:] = forged
        assert decode_page(slot, expected_key=location.key).meta == meta  # checksum holds
        del slot
    finally:
        maps.close()


async def test_a_page_forged_in_the_arena_is_never_served(root, ns, spec):
    """A tenant's client overwrites a committed page in its arena with another payload and a
    recomputed checksum. Gets, streamed or zero-copy, end the prefix before it (a corrupt
    miss, counted); closing the daemon does not persist it to SSD, so the next daemon does not
    serve it either; the block can be stored again."""
    config = small_config(root, tenant_tokens=TOKENS)
    tokens, kv = random_tokens(48), random_kv(spec, 48)
    evil = random_kv(spec, 16, seed=99)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
            assert await acme.put(ns, tokens, kv, zero_copy=True) == 48
            lease = await acme.acquire(ns, tokens)
            await asyncio.to_thread(_forge, fd_socket_path(daemon.socket_path),
                                    lease.blocks[1], evil)
            await acme.release(lease.lease_id)
            got = await acme.get(ns, tokens, zero_copy=False)
            assert torch.equal(got, kv[:, :, :16])  # the forged block and what follows: gone
            assert (await acme.stats()).tiers["dram"].corrupt == 0  # tenants see their blocks
            assert daemon.store.stats().tiers["dram"].corrupt == 1
            assert torch.equal(await acme.get(ns, tokens, zero_copy=True), kv[:, :, :16])
    finally:
        await daemon.stop(1.0)  # persists DRAM-only blocks to SSD: not the forged one
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
            assert torch.equal(await acme.get(ns, tokens, zero_copy=False), kv[:, :, :16])
            assert await acme.put(ns, tokens, kv, zero_copy=True) == 16  # only it was lost
            assert torch.equal(await acme.get(ns, tokens, zero_copy=True), kv)
    finally:
        await daemon.stop(1.0)


def _poisoned_payloads(codec_name: str, spec, block: torch.Tensor) -> dict[str, bytes]:
    """Payloads that make a well-formed page (valid header and checksum) around something that
    is not this block's K/V under ``codec_name``."""
    codec, other = codecs.get(codec_name), codecs.get("fp8_e4m3" if codec_name == "raw" else "raw")
    good = codec.encode(block)
    poisoned = {
        "garbage": bytes(torch.randint(0, 256, (len(good),), dtype=torch.uint8).numpy()),
        "truncated": good[:len(good) // 2],
        "fewer tokens": codec.encode(block[:, :, :8]),
        "another dtype": codec.encode(block.to(torch.float16)),
    }
    if len(other.encode(block)) <= len(good):  # a blob of another codec that fits the slot
        poisoned["another codec"] = other.encode(block)
    if codec_name == "raw":
        poisoned["nan"] = codec.encode(torch.full_like(block, float("nan")))
    return poisoned


def _write_page(channel: str, ns, grant, codec_name: str, payload: bytes) -> None:
    """Write a page of ``payload`` into a reserved slot, its header and checksum valid."""
    codec = codecs.get(codec_name)
    meta = PageMeta(key=grant.key, namespace=ns.fingerprint, parent=grant.parent,
                    block_index=grant.block_index, tenant=ns.tenant, model_id=ns.model_id,
                    codec=codec.name, codec_id=codec.codec_id)
    page = encode_page(meta, payload)
    assert len(page) <= grant.capacity_bytes
    maps = ArenaMaps(token=TOKENS[ns.tenant], channel=channel)
    try:
        maps.view(grant.region, grant.offset, len(page), writable=True)[:] = page
    finally:
        maps.close()


@pytest.mark.parametrize("codec_name", ["raw", "fp8_e4m3"])
async def test_commit_refuses_a_page_that_does_not_decode(root, ns, spec, codec_name):
    """Each poisoned page (valid header and checksum, a payload that is garbage, truncated, of
    another shape, dtype or codec, or NaN) fails Commit naming its block and frees the slots;
    the daemon serves on: the same prefix is put again at once, another tenant's puts work,
    and shutdown (persisting fp8 DRAM pages to a raw SSD tier: a transcode) is clean."""
    config = small_config(root, tenant_tokens=TOKENS)
    config = dataclasses.replace(config, dram=dataclasses.replace(config.dram, codec=codec_name))
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    daemon = await serve(config)
    channel = fd_socket_path(daemon.socket_path)
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme, \
                AsyncClient(daemon.unix_address, token="tok-zeta", retry=NO_RETRY) as zeta:
            poisoned = _poisoned_payloads(codec_name, spec, kv[:, :, 16:32])
            for i, (what, payload) in enumerate(poisoned.items()):
                reservation = await acme.reserve(ns, tokens)
                assert reservation.codec == codec_name and len(reservation.blocks) == 2
                good = codecs.get(codec_name).encode(kv[:, :, :16])
                first, second = reservation.blocks
                await asyncio.to_thread(_write_page, channel, ns, first, codec_name, good)
                await asyncio.to_thread(_write_page, channel, ns, second, codec_name, payload)
                with pytest.raises(CorruptPage, match=second.key.hex()):
                    await acme.commit(reservation.reservation_id)
                stats = await acme.stats()
                assert stats.active_reservations == 0, what
                assert (await acme.lookup(ns, tokens)).matched_tokens == 0, what
                other = random_tokens(32, seed=100 + i)
                assert await zeta.put(zeta_ns, other, random_kv(spec, 32, seed=i),
                                      zero_copy=True) == 32, what
            assert await acme.put(ns, tokens, kv, zero_copy=True) == 32
            got = await acme.get(ns, tokens, zero_copy=True)
            assert got is not None and got.shape == kv.shape
            assert ((got.float() - kv.float()).norm() / kv.float().norm()).item() < 0.1
    finally:
        await daemon.stop(1.0)
    daemon = await serve(config)  # the blocks were persisted, transcoded for fp8
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
            assert (await acme.lookup(ns, tokens)).matched_tokens == 32
            assert (await acme.get(ns, tokens, zero_copy=False)).shape == kv.shape
    finally:
        await daemon.stop(1.0)
