"""Pages a client could tamper with: forged pages in its own arena are never served (seals)."""

from __future__ import annotations

import asyncio

import torch

from kvstore import codecs
from kvstore.client import NO_RETRY, AsyncClient
from kvstore.client.arena import ArenaMaps
from kvstore.page import decode_page, encode_page
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
