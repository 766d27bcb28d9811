"""Abort: a reservation's slots go back unpublished, and unknown ids are NOT_FOUND."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from kvstore.client import Client
from kvstore.client.mappings import ArenaMaps, write_reservation
from kvstore.errors import LeaseNotFound
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.descriptors import fd_socket_path

from ..conftest import random_kv, random_tokens
from .helpers import DaemonThread


async def _write_slots(daemon, ns, kv, reservation) -> None:
    """Write valid pages into the reservation's slots, as a client of its tenant would (in a
    thread: the descriptor socket is served by this test's own event loop)."""
    maps = ArenaMaps(channel=fd_socket_path(daemon.socket_path))
    try:
        await asyncio.to_thread(write_reservation, maps, ns, kv, reservation)
    finally:
        maps.close()


async def test_abort_frees_the_slots_unpublished(daemon, aclient, ns, spec):
    tokens, kv = random_tokens(48), random_kv(spec, 48)
    reservation = await aclient.reserve(ns, tokens)
    assert len(reservation.blocks) == 3
    await _write_slots(daemon, ns, kv, reservation)  # an abort still publishes none of them
    assert (await aclient.stats()).active_reservations == 1
    await aclient.abort(reservation.reservation_id)
    assert (await aclient.stats()).active_reservations == 0
    assert (await aclient.lookup(ns, tokens)).matched_tokens == 0
    assert await aclient.put(ns, tokens, kv, zero_copy=False) == 48
    assert torch.equal(await aclient.get(ns, tokens, zero_copy=False), kv)
    # the reservation is gone for good: neither a second abort nor a commit finds it
    with pytest.raises(LeaseNotFound):
        await aclient.abort(reservation.reservation_id)
    with pytest.raises(LeaseNotFound):
        await aclient.commit(reservation.reservation_id)


async def test_abort_after_commit_is_not_found(daemon, aclient, ns, spec):
    tokens, kv = random_tokens(32, seed=5), random_kv(spec, 32, seed=5)
    reservation = await aclient.reserve(ns, tokens)
    await _write_slots(daemon, ns, kv, reservation)
    assert await aclient.commit(reservation.reservation_id) == 32
    with pytest.raises(LeaseNotFound):
        await aclient.abort(reservation.reservation_id)
    assert torch.equal(await aclient.get(ns, tokens, zero_copy=False), kv)


async def test_abort_of_an_unknown_id_is_not_found_async(daemon, aclient):
    with pytest.raises(LeaseNotFound, match="no-such-reservation"):
        await aclient.abort("no-such-reservation")
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await pbg.KVStoreStub(channel).Abort(pb.AbortRequest(reservation_id="nope"))
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_abort_of_an_unknown_id_is_not_found_sync(config):
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        with pytest.raises(LeaseNotFound, match="no-such-reservation"):
            client.abort("no-such-reservation")
        assert client.health().status == "SERVING"  # the daemon keeps serving
