"""Pages a client could tamper with: stored pages lie in published memory no client can write
by any route, and Commit refuses pages that would not decode. (What a client keeps of published
memory given back: ``test_passed_descriptors.py``.)"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from kvstore import codecs
from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.client.mappings import ArenaMaps, fetch_region_fd
from kvstore.errors import CorruptPage
from kvstore.page import HEADER_BYTES, PageMeta, encode_page, parse_page, verify_page, write_page
from kvstore.rpc.descriptors import fd_socket_path
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from ..tiers.published_attacks import all_refused, attack
from .helpers import DaemonThread, MiB, small_config, wait_for
from .hostile import eventually

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}


def _attack_published(channel: str, location) -> dict[str, str]:
    """What a client of the tenant can do to a stored page: it asks for the descriptor of the
    region the page is in (the daemon hands it over) and tries every route to change it."""
    maps = ArenaMaps(token=TOKENS["acme"], channel=channel)
    try:
        with pytest.raises(PermissionError):  # the client library's own writable mapping
            maps.view(location.region, location.offset, location.length, writable=True)
        maps.view(location.region, location.offset, location.length)
        assert maps.is_trusted(location.region)
    finally:
        maps.close()
    fd = fetch_region_fd(channel, location.region, TOKENS["acme"])
    try:
        return attack(fd, location.offset + location.length - 100)
    finally:
        os.close(fd)


async def test_no_client_route_changes_a_stored_page(root, ns, spec):
    """Regression guard: reads of stored DRAM pages skip the private copy and the second hash,
    which is safe only while no client can change them. A tenant's client holding the
    descriptor of the region its pages are in tries every route (write, pwrite, writable and
    private mappings, mprotect, a writable reopen through /proc, /proc/self/mem, truncating,
    punching holes, MADV_REMOVE, seals, copy_file_range): none changes a byte, and gets,
    streamed and zero-copy, return what was put, with nothing counted corrupt."""
    config = small_config(root, tenant_tokens=TOKENS)
    tokens, kv = random_tokens(48), random_kv(spec, 48)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
            assert await acme.put(ns, tokens, kv, zero_copy=True) == 48
            lease = await acme.acquire(ns, tokens)
            outcomes = await asyncio.to_thread(_attack_published,
                                               fd_socket_path(daemon.socket_path),
                                               lease.blocks[1])
            assert all_refused(outcomes), outcomes
            await acme.release(lease.lease_id)
            assert torch.equal(await acme.get(ns, tokens, zero_copy=False), kv)
            assert torch.equal(await acme.get(ns, tokens, zero_copy=True), kv)
            assert daemon.store.stats().tiers["dram"].corrupt == 0
    finally:
        await daemon.stop(1.0)


class _UnmapRecorder:
    def __init__(self) -> None:
        self.unmapped: list[tuple[int, int]] = []

    def note(self, address: int, nbytes: int) -> None:
        self.unmapped.append((address, nbytes))


def _mapped_memfds() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split("/memfd:")[1].split()[0] for line in maps if "/memfd:" in line}


async def test_a_client_lets_go_of_a_region_the_daemon_gave_back(root, ns, spec):
    """acme's client maps the published steps its blocks are in; acme's blocks go and zeta
    needs the memory, so the daemon gives those steps back. The daemon tells acme's session at
    once (a Hold event), and the client, idle, closes its mappings and descriptors of them:
    nothing in this process maps them any more, so their memory is free (a client that kept
    them would hold memory the budget has lent to zeta). Regression: an idle client held them
    until its next read."""
    config = small_config(root, dram_bytes=4 * MiB, tenant_tokens=TOKENS)
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens, kv = random_tokens(16 * 200), random_kv(spec, 16 * 200)
    daemon = await serve(config)
    try:
        dram = daemon.store.tiers["dram"]
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme, \
                AsyncClient(daemon.unix_address, token="tok-zeta", retry=NO_RETRY) as zeta:
            assert await acme.put(ns, tokens, kv, zero_copy=False) == 16 * 200
            assert torch.equal(await acme.get(ns, tokens, zero_copy=True), kv)
            maps = acme._zero_copy.maps
            steps = set(dram.published_regions("acme")) & set(maps.regions)  # the ones read
            assert len(steps) >= 2
            assert {f"kvstore-{name}" for name in steps} <= _mapped_memfds()
            await acme.flush_releases()  # the get's lease, released after it returned
            recorder = _UnmapRecorder()
            maps.on_unmap(recorder.note)  # what a GPU client unregisters its pinning with
            assert await daemon.store.evict(tenant="acme") == 200
            other = random_tokens(16 * 400, seed=5)
            assert await zeta.put(zeta_ns, other, random_kv(spec, 16 * 400, seed=5),
                                  zero_copy=False) == 16 * 400
            given_back = steps - set(dram.published_regions("acme"))
            assert given_back and all(dram.region_fd(name) is None for name in given_back)
            # acme makes no call meanwhile
            assert await eventually(lambda: not set(maps.regions) & given_back, 10.0)
            assert not {f"kvstore-{name}" for name in given_back} & _mapped_memfds()
            assert len(recorder.unmapped) == len(given_back)
            small, small_kv = random_tokens(32, seed=9), random_kv(spec, 32, seed=9)
            assert await acme.put(ns, small, small_kv, zero_copy=False) == 32
            assert torch.equal(await acme.get(ns, small, zero_copy=True), small_kv)
    finally:
        await daemon.stop(1.0)


def test_an_idle_blocking_client_lets_go_of_a_region_the_daemon_gave_back(root, ns, spec):
    """The same through the blocking client, whose Hold stream a thread of its own reads: the
    client drops the regions the daemon gave back while its caller makes no call at all."""
    config = small_config(root, dram_bytes=4 * MiB, tenant_tokens=TOKENS)
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens, kv = random_tokens(16 * 200, seed=11), random_kv(spec, 16 * 200, seed=11)
    thread = DaemonThread(config)
    with thread as daemon, \
            Client(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme, \
            Client(daemon.unix_address, token="tok-zeta", retry=NO_RETRY) as zeta:
        dram = daemon.store.tiers["dram"]
        assert acme.put(ns, tokens, kv, zero_copy=False) == 16 * 200
        assert torch.equal(acme.get(ns, tokens, zero_copy=True), kv)
        maps = acme._zero_copy.maps
        steps = set(maps.regions) & set(dram.published_regions("acme"))
        assert steps
        acme.flush_releases()
        assert thread.call(daemon.store.evict(tenant="acme")) == 200
        other = random_tokens(16 * 400, seed=12)
        assert zeta.put(zeta_ns, other, random_kv(spec, 16 * 400, seed=12),
                        zero_copy=False) == 16 * 400
        given_back = steps - set(dram.published_regions("acme"))
        assert given_back
        assert wait_for(lambda: not set(maps.regions) & given_back)
        assert not {f"kvstore-{name}" for name in given_back} & _mapped_memfds()


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


def _write_framed(channel: str, ns, grant, block: torch.Tensor, checksum: bytes | None) -> None:
    """Write ``block``'s raw page into a reserved slot the way a client does when the
    reservation is sealed (no hashing, both checksums zero), or with ``checksum`` over the
    page's checksum field (what a broken or hostile writer might leave there)."""
    codec = codecs.get("raw")
    meta = PageMeta(key=grant.key, namespace=ns.fingerprint, parent=grant.parent,
                    block_index=grant.block_index, tenant=ns.tenant, model_id=ns.model_id,
                    codec=codec.name, codec_id=codec.codec_id)
    maps = ArenaMaps(token=TOKENS[ns.tenant], channel=channel)
    try:
        view = maps.view(grant.region, grant.offset, grant.capacity_bytes, writable=True)
        length = write_page(view, meta, codec.prepare(block), aligned=True, sums=False)
        if checksum is not None:
            view[HEADER_BYTES - len(checksum):HEADER_BYTES] = checksum
        assert length <= grant.capacity_bytes
    finally:
        maps.close()


async def test_commit_seals_what_it_copies(root, ns, spec):
    """A host reservation says its commit seals the pages: the writer hashes nothing and
    leaves both checksums zero (or garbage), and the commit computes them on its own copy. The
    published page verifies in full (not only as trusted), survives a restart through the
    SSD, and gets return exactly what was written."""
    config = small_config(root, tenant_tokens=TOKENS)
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    daemon = await serve(config)
    channel = fd_socket_path(daemon.socket_path)
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
            reservation = await acme.reserve(ns, tokens)
            assert reservation.sealed and len(reservation.blocks) == 2
            for grant, checksum in zip(reservation.blocks, (None, b"\xab" * 8)):
                block = kv[:, :, grant.block_index * 16:(grant.block_index + 1) * 16]
                await asyncio.to_thread(_write_framed, channel, ns, grant, block, checksum)
            assert await acme.commit(reservation.reservation_id) == 32
            dram = daemon.store.tiers["dram"]
            for grant in reservation.blocks:
                page = await dram.read(grant.key)
                assert page.is_trusted
                verify_page(parse_page(bytes(page.data), expected_key=grant.key))
            assert torch.equal(await acme.get(ns, tokens, zero_copy=True), kv)
            assert torch.equal(await acme.get(ns, tokens, zero_copy=False), kv)
    finally:
        await daemon.stop(1.0)
    daemon = await serve(config)  # persisted to the SSD tier, read back and verified there
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
            assert torch.equal(await acme.get(ns, tokens, zero_copy=False), kv)
            assert (await acme.stats()).tiers["ssd"].corrupt == 0
    finally:
        await daemon.stop(1.0)


@pytest.mark.parametrize("piece_bytes", [4096, 1000])
async def test_commit_finds_a_nan_in_any_piece_of_the_copy(root, ns, spec, monkeypatch,
                                                          piece_bytes):
    """The commit checks a raw page for NaN and Inf piece by piece as its copy lands: one bad
    value in the first, a middle or the last piece (pieces that cut values in two, too) fails
    the commit naming the block; the same page without it commits."""
    monkeypatch.setattr("kvstore.tiers.dram.staging.CHECK_PIECE_BYTES", piece_bytes)
    config = small_config(root, tenant_tokens=TOKENS)
    tokens, kv = random_tokens(16), random_kv(spec, 16)
    daemon = await serve(config)
    channel = fd_socket_path(daemon.socket_path)
    try:
        async with AsyncClient(daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
            flat = kv.reshape(-1)
            for where, bad in ((0, float("nan")), (flat.numel() // 2 + 1, float("inf")),
                               (flat.numel() - 1, float("-inf"))):
                poisoned = kv.clone()
                poisoned.view(-1)[where] = bad
                reservation = await acme.reserve(ns, tokens)
                (grant,) = reservation.blocks
                await asyncio.to_thread(_write_framed, channel, ns, grant, poisoned, None)
                with pytest.raises(CorruptPage, match=f"{grant.key.hex()} decodes to NaN"):
                    await acme.commit(reservation.reservation_id)
                assert (await acme.lookup(ns, tokens)).matched_tokens == 0
            reservation = await acme.reserve(ns, tokens)
            await asyncio.to_thread(_write_framed, channel, ns, reservation.blocks[0], kv, None)
            assert await acme.commit(reservation.reservation_id) == 16
            assert torch.equal(await acme.get(ns, tokens, zero_copy=True), kv)
    finally:
        await daemon.stop(1.0)
