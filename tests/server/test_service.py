"""The servicer through AsyncClient against an in-process daemon on a temp Unix socket."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import grpc
import pytest
import torch

from kvstore.api import BlockInfo, LookupResult, StoreStats
from kvstore.client import AsyncClient
from kvstore.client.mappings import ArenaMaps
from kvstore.errors import (
    CorruptPage,
    InvalidArgument,
    KVStoreError,
    LeaseNotFound,
    NotFound,
)
from kvstore.keys import block_keys
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import namespace_to_proto, tokens_to_bytes
from kvstore.rpc.descriptors import fd_socket_path
from kvstore.rpc.tensors import tensor_view
from kvstore.store.slices import LoopShare

from ..conftest import random_kv, random_tokens


@pytest.mark.parametrize("put_zero_copy", [False, True])
@pytest.mark.parametrize("get_zero_copy", [False, True])
async def test_round_trip_bit_exact(aclient, ns, spec, put_zero_copy, get_zero_copy):
    tokens = random_tokens(88)
    kv = random_kv(spec, 88)
    assert await aclient.put(ns, tokens, kv, zero_copy=put_zero_copy) == 80
    got = await aclient.get(ns, tokens, zero_copy=get_zero_copy)
    assert got.dtype == kv.dtype and torch.equal(got, kv[:, :, :80])
    assert await aclient.put(ns, tokens, kv, zero_copy=put_zero_copy) == 0  # already stored


async def test_float16_and_large_streamed_tensor(aclient, ns, spec):
    """More than one 4 MiB chunk each way: the stream reassembles in order."""
    wide = dataclasses.replace(spec, dtype="float16", num_layers=8, num_kv_heads=4, head_dim=128)
    ns16 = dataclasses.replace(ns, spec=wide)
    tokens = random_tokens(640)
    kv = random_kv(wide, 640)
    assert kv.numel() * 2 > 8 << 20
    assert await aclient.put(ns16, tokens, kv, zero_copy=False) == 640
    assert torch.equal(await aclient.get(ns16, tokens, zero_copy=False), kv)


async def test_lookup_returns_store_types(aclient, ns, spec):
    tokens = random_tokens(64)
    await aclient.put(ns, tokens[:32], random_kv(spec, 32))
    result = await aclient.lookup(ns, tokens)
    assert isinstance(result, LookupResult)
    assert (result.num_tokens, result.matched_tokens, result.tokens_per_tier) == \
        (64, 32, {"dram": 32})
    assert result.keys == tuple(block_keys(ns, tokens[:32]))
    assert await aclient.get(ns, random_tokens(32, seed=5)) is None
    assert await aclient.get(ns, random_tokens(32, seed=5), zero_copy=True) is None



async def test_lookup_answers_packed_keys_to_who_asks_and_repeated_keys_to_older_clients(
        daemon, aclient, ns, spec):
    """The client asks for packed keys (one bytes field); a request without ``packed`` (an
    older client) gets the same keys in the repeated field, and nothing packed."""
    tokens = random_tokens(80)
    await aclient.put(ns, tokens[:48], random_kv(spec, 48))
    expected = block_keys(ns, tokens[:48])
    request = pb.LookupRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens))
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        old = await stub.Lookup(request)
        request.packed = True
        new = await stub.Lookup(request)
    assert list(old.keys) == expected and not old.packed_keys
    assert new.packed_keys == b"".join(expected) and not new.keys
    assert (old.matched_tokens, new.matched_tokens) == (48, 48)
    assert (await aclient.lookup(ns, tokens)).keys == tuple(expected)

async def test_a_long_lookups_reply_is_built_in_slices_and_holds_every_key(daemon, aclient, ns,
                                                                           spec):
    """A chain longer than a slice: the reply's keys are joined (packed) or added (repeated)
    a slice at a time, with a loop turn between slices, and both forms hold every key in
    order."""
    daemon.store.share = LoopShare(slice_blocks=2)  # 7 blocks: 4 slices
    tokens = random_tokens(16 * 7 + 5)
    await aclient.put(ns, tokens, random_kv(spec, len(tokens)))
    expected = block_keys(ns, tokens)
    request = pb.LookupRequest(namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens))
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        pauses = daemon.store.share.num_pauses
        old = await stub.Lookup(request)
        unpacked_pauses = daemon.store.share.num_pauses - pauses
        request.packed = True
        new = await stub.Lookup(request)
    assert list(old.keys) == expected and new.packed_keys == b"".join(expected)
    assert unpacked_pauses >= 4 * 3  # hashing, probing, the sightings and the reply: 3 each
    assert (await aclient.lookup(ns, tokens)).keys == tuple(expected)


async def test_stats_list_evict_hint_health(aclient, ns, spec):
    tokens = random_tokens(48)
    await aclient.put(ns, tokens, random_kv(spec, 48), zero_copy=False)
    stats = await aclient.stats()
    assert isinstance(stats, StoreStats)
    assert stats.tiers["dram"].num_blocks == 3 and stats.counters.puts == 1
    blocks = await aclient.list_blocks(tenant="acme")
    assert len(blocks) == 3 and all(isinstance(b, BlockInfo) for b in blocks)
    assert {b.block_index for b in blocks} == {0, 1, 2}
    assert {b.parent for b in blocks if b.block_index == 0} == {None}
    assert await aclient.hint(ns, tokens, deadline_s=1.0) == 0  # all in DRAM already
    health = await aclient.health()
    assert (health.status, health.is_admin, health.pid) == ("SERVING", True, os.getpid())
    keys = block_keys(ns, tokens)
    assert await aclient.evict(keys=keys[2:]) == 1
    assert (await aclient.lookup(ns, tokens)).matched_tokens == 32
    assert await aclient.evict(everything=True) == 2
    assert (await aclient.stats()).tiers["dram"].num_blocks == 0


async def test_leases(aclient, ns, spec):
    tokens = random_tokens(32)
    await aclient.put(ns, tokens, random_kv(spec, 32))
    lease = await aclient.acquire(ns, tokens, lease_s=5.0)
    assert lease.matched_tokens == 32 and len(lease.blocks) == 2
    assert (await aclient.stats()).active_leases == 1
    assert await aclient.evict(tenant="acme") == 0  # pinned blocks stay
    await aclient.release(lease.lease_id)
    with pytest.raises(LeaseNotFound):
        await aclient.release(lease.lease_id)
    with pytest.raises(NotFound):
        await aclient.release("no-such-lease")
    with pytest.raises(InvalidArgument, match="lease_s"):
        await aclient.acquire(ns, tokens, lease_s=1e9)


def _scribble(channel: str, reservation) -> None:
    """Overwrite the first 64 bytes of every reserved slot, through the tenant's own mapping."""
    maps = ArenaMaps(channel=channel)
    try:
        for grant in reservation.blocks:
            maps.view(grant.region, grant.offset, 64, writable=True)[:] = b"\xab" * 64
    finally:
        maps.close()


async def test_commit_of_a_damaged_page_is_data_loss(daemon, aclient, ns, spec):
    tokens = random_tokens(32)
    reservation = await aclient.reserve(ns, tokens)
    assert len(reservation.blocks) == 2
    await asyncio.to_thread(_scribble, fd_socket_path(daemon.socket_path), reservation)
    with pytest.raises(CorruptPage):
        await aclient.commit(reservation.reservation_id)
    assert (await aclient.lookup(ns, tokens)).matched_tokens == 0
    # the slots were freed: a proper zero-copy put of the same tokens works
    assert await aclient.put(ns, tokens, random_kv(spec, 32), zero_copy=True) == 32


async def test_unexpected_error_is_internal_and_the_daemon_keeps_serving(
        daemon, aclient, ns, caplog):
    async def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    original = daemon.store.lookup
    daemon.store.lookup = broken
    with caplog.at_level(logging.ERROR, logger="kvstore"), \
            pytest.raises(KVStoreError, match="INTERNAL.*disk on fire"):
        await aclient.lookup(ns, random_tokens(16))
    assert any(r.exc_info and "disk on fire" in str(r.exc_info[1]) for r in caplog.records)
    daemon.store.lookup = original
    assert (await aclient.lookup(ns, random_tokens(16))).matched_tokens == 0


async def test_client_side_validation_raises_before_sending(aclient, ns, spec):
    with pytest.raises(InvalidArgument, match="dtype"):
        await aclient.put(ns, random_tokens(16), random_kv(spec, 16).float(), zero_copy=False)
    with pytest.raises(InvalidArgument, match="tokens"):
        await aclient.lookup(ns, [])


async def test_zero_copy_falls_back_to_streaming_without_arena_access(daemon, ns, spec,
                                                                      monkeypatch):
    """A descriptor socket this process cannot reach (another container that sees only the
    gRPC socket) is not fatal in automatic mode, and a clear error when zero-copy was
    demanded."""
    os.unlink(fd_socket_path(daemon.socket_path))  # the daemon serves on, out of our sight
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    async with AsyncClient(daemon.unix_address) as client:
        assert await client.put(ns, tokens, kv) == 32
        assert torch.equal(await client.get(ns, tokens), kv)
        with pytest.raises(InvalidArgument, match="zero-copy"):
            await client.get(ns, tokens, zero_copy=True)
        # a demanded zero-copy put fails, and gives its reserved slots back at once
        more, more_kv = random_tokens(32, seed=7), random_kv(spec, 32, seed=7)
        with pytest.raises(InvalidArgument, match="zero-copy"):
            await client.put(ns, more, more_kv, zero_copy=True)
        assert (await client.stats()).active_reservations == 0
        assert await client.put(ns, more, more_kv, zero_copy=False) == 32


async def test_get_chunk_size_is_bounded(daemon, aclient, ns, spec):
    """A Get asking for 1-byte chunks gets 64 KiB ones, not a message per byte."""
    wide = dataclasses.replace(spec, num_layers=4, head_dim=128)
    ns_wide = dataclasses.replace(ns, spec=wide)
    tokens, kv = random_tokens(256), random_kv(wide, 256)  # 1 MiB
    await aclient.put(ns_wide, tokens, kv, zero_copy=False)
    request = pb.GetRequest(namespace=namespace_to_proto(ns_wide),
                            tokens=tokens_to_bytes(tokens), chunk_bytes=1)
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        replies = [m async for m in pbg.KVStoreStub(channel).Get(request)]
    chunks = [m.chunk for m in replies[1:]]
    assert replies[0].header.found and len(chunks) == (1 << 20) // (64 << 10)
    assert b"".join(chunks) == bytes(tensor_view(kv))


async def test_reported_prefills_drive_lookup_advice(daemon, aclient, ns, spec):
    """Through the daemon: no profile, no advice; a profile makes lookups advise (here recompute
    is so cheap that fetching never pays); a bad profile is INVALID_ARGUMENT, not a crash."""
    from kvstore.api import ModelProfile

    tokens = list(range(5000, 5064))
    await aclient.put(ns, tokens, random_kv(spec, 64))
    assert (await aclient.lookup(ns, tokens)).advised_tokens is None
    cheap = ModelProfile(num_params=1.0, num_layers=1, hidden_size=1, flops_per_s=1e18)
    await aclient.report_prefill(ns, profile=cheap)
    await aclient.report_prefill(ns, new_tokens=64, cached_tokens=0, seconds=1e-12)
    assert (await aclient.lookup(ns, tokens)).advised_tokens == 0
    costly = ModelProfile(num_params=8e9, num_layers=32, hidden_size=4096, flops_per_s=1e9)
    await aclient.report_prefill(ns, profile=costly)
    assert (await aclient.lookup(ns, tokens)).advised_tokens == 64
    bad = pb.ReportPrefillRequest(namespace=namespace_to_proto(ns),
                                  profile=pb.ModelProfile(num_params=-1))
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pbg.KVStoreStub(channel).ReportPrefill(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "profile" in err.value.details()


async def test_acquire_and_reserve_answer_old_clients_with_a_message_per_block(
        daemon, aclient, ns, spec):
    """A client that does not ask for the packed table (one built before it) gets a
    BlockLocation (SlotGrant) message per block; one that asks gets the same blocks as one
    BlockTable and no per-block messages."""
    from kvstore.rpc.convert import lease_from_proto, reservation_from_proto

    tokens = random_tokens(64, seed=11)
    await aclient.put(ns, tokens, random_kv(spec, 64, seed=11))
    fresh = random_tokens(48, seed=12)
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        leases, reservations = [], []
        for packed in (False, True):
            reply = await stub.Acquire(pb.AcquireRequest(
                namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens), packed=packed))
            assert reply.HasField("table") is packed and len(reply.blocks) == (0 if packed else 4)
            leases.append(lease_from_proto(reply))
            await stub.Release(pb.ReleaseRequest(lease_id=reply.lease_id))
            reply = await stub.Reserve(pb.ReserveRequest(
                namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(fresh), packed=packed))
            assert reply.HasField("table") is packed and len(reply.blocks) == (0 if packed else 3)
            reservations.append(reservation_from_proto(reply))
            await stub.Abort(pb.AbortRequest(reservation_id=reply.reservation_id))
    old, new = leases
    assert len(new.blocks) == 4 and tuple(old.blocks) == tuple(new.blocks)
    assert [b.key for b in new.blocks] == list(block_keys(ns, tokens))
    keys = list(block_keys(ns, fresh))
    for reservation in reservations:
        assert [g.key for g in reservation.blocks] == keys
        assert [g.parent for g in reservation.blocks] == [None, *keys[:2]]
        assert [g.block_index for g in reservation.blocks] == [0, 1, 2]


async def test_acquire_from_a_first_block_names_its_tier_and_takes_any_first_block(
        daemon, aclient, ns, spec):
    """An Acquire from block k leases blocks k.. only, counts matched tokens from the start and
    names the tier whose slots hold them; a first_block past the match, up to the largest a
    request can carry, leases nothing and is no error; the client refuses a negative one."""
    from kvstore.rpc.convert import lease_from_proto

    tokens = random_tokens(64, seed=21)
    await aclient.put(ns, tokens, random_kv(spec, 64, seed=21))
    keys = list(block_keys(ns, tokens))
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        stub = pbg.KVStoreStub(channel)
        for first, held in ((0, 4), (3, 1), (4, 0), (2**32 - 1, 0)):
            reply = await stub.Acquire(pb.AcquireRequest(
                namespace=namespace_to_proto(ns), tokens=tokens_to_bytes(tokens), packed=True,
                first_block=first))
            lease = lease_from_proto(reply)
            assert lease.matched_tokens == 64 and lease.tier == "dram"
            assert [b.key for b in lease.blocks] == keys[first:first + held]
            await stub.Release(pb.ReleaseRequest(lease_id=reply.lease_id))
    with pytest.raises(InvalidArgument, match="first_block"):
        await aclient.acquire(ns, tokens, first_block=-1)
    assert (await aclient.stats()).active_leases == 0


async def test_a_device_name_steers_placement_only_and_is_bounded(aclient, ns, spec):
    """A reader's or writer's GPU name is a placement hint: one the daemon has no such GPU
    for is served as if none were named; an overlong one is refused by name."""
    tokens = random_tokens(32, seed=22)
    await aclient.put(ns, tokens, random_kv(spec, 32, seed=22))
    lease = await aclient.acquire(ns, tokens, device="GPU-not-here")
    assert lease.matched_tokens == 32
    await aclient.release(lease.lease_id)
    res = await aclient.reserve(ns, random_tokens(32, seed=23), device="GPU-not-here")
    await aclient.abort(res.reservation_id)
    for call in (lambda: aclient.acquire(ns, tokens, device="G" * 65),
                 lambda: aclient.reserve(ns, tokens, device="G" * 65)):
        with pytest.raises(InvalidArgument, match="device names a GPU in at most 64"):
            await call()
    assert (await aclient.stats()).active_leases == 0
