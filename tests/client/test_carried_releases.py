"""A shared-memory get's Release rides on the client's next Acquire or Reserve (no round trip
of its own); one no call carried within ``RELEASE_LINGER_S`` goes alone, as does every one
when the daemon does not read the carried ids. Which calls were made is read from the
daemon's per-method RPC counts; what is held from its stats."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvstore.client import AsyncClient, Client, releases
from kvstore.client.releases import RELEASE_LINGER_S
from kvstore.keys import Namespace
from kvstore.server.service import KVStoreService
from kvstore.spec import KVSpec
from tests.server.helpers import DaemonThread, rpc_calls, small_config, wait_for

from ..conftest import random_kv

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=16)
NS = Namespace(model_id="m", spec=SPEC, tenant="acme")
PROMPTS = [list(range(i * 1000, i * 1000 + 64)) for i in range(3)]


def _stored(client, kvs) -> None:
    for tokens, kv in zip(PROMPTS, kvs):
        client.put(NS, tokens, kv, zero_copy=True)


@pytest.fixture
def long_linger(monkeypatch):
    """Releases wait for the next call for 30 s: nothing but a carrying call (or a flush)
    sends them within a test."""
    monkeypatch.setattr(releases.LateReleases, "LINGER_S", 30.0)


def test_the_next_get_carries_the_last_gets_release(tmp_path, long_linger):
    kvs = [random_kv(SPEC, 64, seed=i) for i in range(3)]
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        _stored(client, kvs)
        for tokens, kv in zip(PROMPTS, kvs):
            assert torch.equal(client.get(NS, tokens, zero_copy=True), kv)
            assert client.stats().active_leases == 1  # only the last get's: the others went
        assert rpc_calls(daemon, "Release") == 0  # each rode on the next Acquire
        # A put makes room with this client's leases released first: its Reserve carries them.
        client.put(NS, list(range(50_000, 50_064)), kvs[0], zero_copy=True)
        assert client.stats().active_leases == 0 and rpc_calls(daemon, "Release") == 0
        client.get(NS, PROMPTS[0], zero_copy=True)
        client.flush_releases()  # what waits goes now, in a Release of its own
        assert client.stats().active_leases == 0 and rpc_calls(daemon, "Release") == 1


def test_a_release_no_call_carries_goes_alone_after_the_linger(tmp_path):
    kv = random_kv(SPEC, 64)
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        client.put(NS, PROMPTS[0], kv, zero_copy=True)
        start = time.monotonic()
        assert torch.equal(client.get(NS, PROMPTS[0], zero_copy=True), kv)
        assert wait_for(lambda: rpc_calls(daemon, "Release") == 1, timeout_s=5.0)
        assert time.monotonic() - start >= RELEASE_LINGER_S
        assert client.stats().active_leases == 0


def test_a_daemon_that_ignores_carried_ids_gets_releases_alone(tmp_path, monkeypatch,
                                                               long_linger):
    """A daemon older than the field answers ``released`` 0 and holds the leases: the client
    sends them itself and stops carrying."""
    async def ignores(self, lease_ids, scope):
        return 0
    monkeypatch.setattr(KVStoreService, "_release_carried", ignores)
    kvs = [random_kv(SPEC, 64, seed=i) for i in range(3)]
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        _stored(client, kvs)
        for tokens, kv in zip(PROMPTS, kvs):
            assert torch.equal(client.get(NS, tokens, zero_copy=True), kv)
        assert not client._late.can_carry
        assert wait_for(lambda: rpc_calls(daemon, "Release") == 1)  # the first, handed back
        client.flush_releases()
        assert rpc_calls(daemon, "Release") == 3 and client.stats().active_leases == 0


def test_a_carried_release_of_an_expired_lease_is_not_an_error(tmp_path, monkeypatch,
                                                              long_linger):
    kv = random_kv(SPEC, 64)
    with DaemonThread(small_config(tmp_path)) as daemon, Client(daemon.unix_address) as client:
        client.put(NS, PROMPTS[0], kv, zero_copy=True)
        lease = client.acquire(NS, PROMPTS[0], lease_s=0.2)
        client._late.send(lease.lease_id)
        assert wait_for(lambda: client.stats().active_leases == 0)  # reaped at its deadline
        assert torch.equal(client.get(NS, PROMPTS[0], zero_copy=True), kv)  # carries it
        assert client.stats().active_leases == 1 and rpc_calls(daemon, "Release") == 0


async def test_the_async_client_carries_its_releases_too(tmp_path, monkeypatch):
    monkeypatch.setattr(releases, "RELEASE_LINGER_S", 30.0)
    kvs = [random_kv(SPEC, 64, seed=i) for i in range(3)]
    with DaemonThread(small_config(tmp_path)) as daemon:
        async with AsyncClient(daemon.unix_address) as client:
            for tokens, kv in zip(PROMPTS, kvs):
                await client.put(NS, tokens, kv, zero_copy=True)
            for tokens, kv in zip(PROMPTS, kvs):
                assert torch.equal(await client.get(NS, tokens, zero_copy=True), kv)
            assert (await client.stats()).active_leases == 1
            assert rpc_calls(daemon, "Release") == 0
            await client.flush_releases()
            assert (await client.stats()).active_leases == 0
            assert rpc_calls(daemon, "Release") == 1


async def test_an_acquire_carries_at_most_the_daemons_limit(tmp_path, monkeypatch):
    """More late Releases waiting than one call may carry (80 concurrent gets' leases): the
    next Acquire takes 64 of them and succeeds; the rest wait for the next call."""
    monkeypatch.setattr(releases, "RELEASE_LINGER_S", 30.0)
    kv = random_kv(SPEC, 64)
    with DaemonThread(small_config(tmp_path)) as daemon:
        async with AsyncClient(daemon.unix_address) as client:
            await client.put(NS, PROMPTS[0], kv, zero_copy=True)
            got = await asyncio.gather(*(client.get(NS, PROMPTS[0], zero_copy=True)
                                         for _ in range(80)))
            assert all(torch.equal(g, kv) for g in got)
            assert (await client.stats()).active_leases == 80
            assert torch.equal(await client.get(NS, PROMPTS[0], zero_copy=True), kv)
            assert (await client.stats()).active_leases == 80 - 64 + 1
            assert rpc_calls(daemon, "Release") == 0
            await client.flush_releases()
            assert (await client.stats()).active_leases == 0
