"""A zero-copy put whose slot write fails or is interrupted aborts its reservation at once, so
the same blocks are writable again immediately rather than after the reservation's deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from kvstore.client import AsyncClient, Client
from kvstore.client import aio as aio_module
from kvstore.client import sync as sync_module
from kvstore.client.mappings import write_reservation
from kvstore.errors import CodecError
from tests.server.helpers import DaemonThread

from ..conftest import random_kv, random_tokens

LEASE_S = 3600.0  # long enough that only an Abort can free the slots within the test


class StoreSpy:
    """Records the reservation ids the daemon's store is asked to commit and abort."""

    def __init__(self, store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commits: list[str] = []
        self.aborts: list[str] = []
        for name, calls in (("commit", self.commits), ("abort", self.aborts)):
            monkeypatch.setattr(store, name, self._recording(getattr(store, name), calls))

    @staticmethod
    def _recording(method, calls: list[str]):
        async def record(reservation_id: str):
            calls.append(reservation_id)
            return await method(reservation_id)

        return record


def failing_writer(exc: BaseException, reserved: list):
    """A slot writer that writes the first block's page, then fails with ``exc``."""

    def write(maps, ns, kv, reservation, first_block=0, copy_threads=1):
        reserved.append(reservation)
        write_reservation(maps, ns, kv, dataclasses.replace(reservation,
                                                            blocks=reservation.blocks[:1]),
                          first_block, copy_threads)
        raise exc

    return write


def long_reservations(client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the client's zero-copy puts reserve for an hour, so an expired reservation can
    never be what frees the slots."""
    reserve = client.reserve
    monkeypatch.setattr(client, "reserve", lambda ns, tokens, lease_s=None:
                        reserve(ns, tokens, LEASE_S))


@pytest.mark.parametrize("exc", [CodecError("cannot encode this block"), KeyboardInterrupt()])
def test_sync_failing_write_aborts(config, ns, spec, monkeypatch, exc):
    tokens, kv = random_tokens(48), random_kv(spec, 48)
    reserved: list = []
    monkeypatch.setattr(sync_module, "write_reservation", failing_writer(exc, reserved))
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        spy = StoreSpy(daemon.store, monkeypatch)
        long_reservations(client, monkeypatch)
        with pytest.raises(type(exc)):
            client.put(ns, tokens, kv, zero_copy=True)
        assert spy.aborts == [reserved[0].reservation_id] and spy.commits == []
        assert client.stats().active_reservations == 0
        assert client.lookup(ns, tokens).matched_tokens == 0  # the written page stayed private
        assert client.put(ns, tokens, kv, zero_copy=False) == 48
        assert torch.equal(client.get(ns, tokens, zero_copy=False), kv)


async def test_async_failing_write_aborts(daemon, ns, spec, monkeypatch):
    tokens, kv = random_tokens(48, seed=2), random_kv(spec, 48, seed=2)
    reserved: list = []
    monkeypatch.setattr(aio_module, "write_reservation",
                        failing_writer(CodecError("cannot encode this block"), reserved))
    spy = StoreSpy(daemon.store, monkeypatch)
    async with AsyncClient(daemon.unix_address) as client:
        long_reservations(client, monkeypatch)
        with pytest.raises(CodecError, match="cannot encode"):
            await client.put(ns, tokens, kv, zero_copy=True)
        assert spy.aborts == [reserved[0].reservation_id] and spy.commits == []
        assert (await client.stats()).active_reservations == 0
        assert (await client.lookup(ns, tokens)).matched_tokens == 0
        assert await client.put(ns, tokens, kv, zero_copy=False) == 48
        assert torch.equal(await client.get(ns, tokens, zero_copy=False), kv)


async def test_async_cancelled_put_aborts_after_the_writer_stops(daemon, ns, spec, monkeypatch):
    """Cancelling the caller cannot stop the worker thread writing the slots, so the abort
    waits for it: slots freed under a running writer could be handed to another put and
    overwritten."""
    tokens, kv = random_tokens(32, seed=4), random_kv(spec, 32, seed=4)
    started, proceed, finished = threading.Event(), threading.Event(), threading.Event()

    def slow_writer(maps, ns, kv, reservation, first_block=0, copy_threads=1):
        started.set()
        proceed.wait(30)
        write_reservation(maps, ns, kv, reservation, first_block, copy_threads)
        finished.set()

    monkeypatch.setattr(aio_module, "write_reservation", slow_writer)
    spy = StoreSpy(daemon.store, monkeypatch)
    async with AsyncClient(daemon.unix_address) as client:
        long_reservations(client, monkeypatch)
        put = asyncio.create_task(client.put(ns, tokens, kv, zero_copy=True))
        assert await asyncio.to_thread(started.wait, 30)
        put.cancel()
        # a full round trip through the daemon: the cancellation has been handled by now
        assert (await client.stats()).active_reservations == 1
        assert spy.aborts == [] and not put.done()
        proceed.set()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert finished.is_set() and len(spy.aborts) == 1 and spy.commits == []
        assert (await client.stats()).active_reservations == 0
        assert await client.put(ns, tokens, kv, zero_copy=False) == 32
        assert torch.equal(await client.get(ns, tokens, zero_copy=False), kv)
