"""The blocking and the asyncio client expose the same surface: the same public methods, with the
same parameters (names, kinds, defaults), and the async twins of the sync-only verbs behave alike
against a real daemon."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

from kvstore.client import AsyncClient, Client, releases
from kvstore.errors import InvalidArgument, NotFound
from tests.server.helpers import DaemonThread, rpc_calls, small_config

from ..conftest import random_kv, random_tokens

# Lifecycle names that differ by design: the async client closes with ``aclose`` and is an
# async context manager.
PAIRS = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}


def surface(cls: type) -> dict[str, list[tuple[str, object, object]]]:
    """Each public method (and context-manager hook) of ``cls`` by its sync name, with its
    parameters as (name, kind, default)."""
    methods = {}
    for name, member in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") and name not in PAIRS and name not in PAIRS.values():
            continue
        params = inspect.signature(member).parameters.values()
        methods[PAIRS.get(name, name)] = [(p.name, p.kind, p.default) for p in params]
    return methods


def test_both_clients_have_the_same_methods_and_parameters():
    sync, aio = surface(Client), surface(AsyncClient)
    assert sorted(sync) == sorted(aio)
    for name, params in sync.items():
        assert params == aio[name], name
    init = [(p.name, p.kind, p.default)
            for p in inspect.signature(Client.__init__).parameters.values()]
    assert init == [(p.name, p.kind, p.default)
                    for p in inspect.signature(AsyncClient.__init__).parameters.values()]


def test_the_async_verbs_are_coroutines_and_the_sync_ones_are_not():
    for name in surface(Client):
        sync = getattr(Client, name)
        aio = getattr(AsyncClient, {v: k for k, v in PAIRS.items()}.get(name, name))
        assert not inspect.iscoroutinefunction(sync), name
        assert inspect.iscoroutinefunction(aio) or name == "__init__", name


async def visited(client: AsyncClient, ns, tokens, first_block: int = 0,
                  zero_copy: bool | None = None) -> tuple[int, dict[int, torch.Tensor]]:
    blocks: dict[int, torch.Tensor] = {}
    count = await client.read_blocks(ns, tokens,
                                     lambda i, kv: blocks.__setitem__(i, kv.clone()),
                                     first_block=first_block, zero_copy=zero_copy)
    return count, blocks


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_async_read_blocks_visits_the_stored_prefix_from_first_block(daemon, ns, spec,
                                                                           zero_copy):
    tokens, kv = random_tokens(80), random_kv(spec, 80)
    bt = spec.block_tokens
    async with AsyncClient(daemon.unix_address) as client:
        await client.put(ns, tokens[:48], kv[:, :, :48], zero_copy=zero_copy)
        count, blocks = await visited(client, ns, tokens, first_block=1, zero_copy=zero_copy)
        assert count == 3 and sorted(blocks) == [1, 2]
        for i, block in blocks.items():
            assert torch.equal(block, kv[:, :, i * bt : (i + 1) * bt])
        assert await visited(client, ns, random_tokens(32, seed=9), zero_copy=zero_copy) == (0, {})


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_async_put_from_first_block_adds_to_a_stored_prefix(daemon, ns, spec, zero_copy):
    tokens, kv = random_tokens(64, seed=2), random_kv(spec, 64, seed=2)
    async with AsyncClient(daemon.unix_address) as client:
        assert await client.put(ns, tokens[:32], kv[:, :, :32], zero_copy=zero_copy) == 32
        assert await client.put(ns, tokens, kv[:, :, 32:], first_block=2,
                                zero_copy=zero_copy) == 32
        assert torch.equal(await client.get(ns, tokens, zero_copy=False), kv)


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_async_put_from_first_block_needs_the_prefix_stored(daemon, ns, spec, zero_copy):
    tokens, kv = random_tokens(64, seed=3), random_kv(spec, 64, seed=3)
    async with AsyncClient(daemon.unix_address) as client:
        await client.put(ns, tokens[:16], kv[:, :, :16], zero_copy=zero_copy)
        with pytest.raises(NotFound, match="block 1 of the prefix is not stored"):
            await client.put(ns, tokens, kv[:, :, 32:], first_block=2, zero_copy=zero_copy)
        assert (await client.lookup(ns, tokens)).matched_tokens == 16  # nothing half-written
        assert (await client.stats()).num_blocks == 1


async def test_async_a_negative_first_block_is_refused(daemon, ns, spec):
    async with AsyncClient(daemon.unix_address) as client:
        with pytest.raises(InvalidArgument, match="first_block"):
            await client.put(ns, random_tokens(16), random_kv(spec, 16), first_block=-1)
        with pytest.raises(InvalidArgument, match="first_block"):
            await client.read_blocks(ns, random_tokens(16), lambda i, kv: None, first_block=-2)


async def test_async_release_later_rides_on_the_next_acquire_or_goes_alone(tmp_path, ns, spec):
    tokens, kv = random_tokens(32, seed=4), random_kv(spec, 32, seed=4)
    with DaemonThread(small_config(tmp_path)) as daemon:
        async with AsyncClient(daemon.unix_address, zero_copy=True) as client:
            await client.put(ns, tokens, kv)
            first = await client.acquire(ns, tokens)
            await client.release_later(first.lease_id)
            second = await client.acquire(ns, tokens)  # carries the first's Release
            assert (await client.stats()).active_leases == 1
            assert rpc_calls(daemon, "Release") == 0
            await client.release_later(second.lease_id)  # no call carries it: goes alone
            async with asyncio.timeout(5.0):
                while rpc_calls(daemon, "Release") < 1:
                    await asyncio.sleep(0.01)
            await client.flush_releases()
            assert rpc_calls(daemon, "Release") == 1
            assert (await client.stats()).active_leases == 0


async def test_async_flush_releases_sends_a_late_release_at_once(tmp_path, ns, spec,
                                                                 monkeypatch):
    monkeypatch.setattr(releases, "RELEASE_LINGER_S", 30.0)
    tokens, kv = random_tokens(32, seed=5), random_kv(spec, 32, seed=5)
    with DaemonThread(small_config(tmp_path)) as daemon:
        async with AsyncClient(daemon.unix_address, zero_copy=True) as client:
            await client.put(ns, tokens, kv)
            lease = await client.acquire(ns, tokens)
            await client.release_later(lease.lease_id)
            assert (await client.stats()).active_leases == 1  # waits for a call to carry it
            await client.flush_releases()
            assert rpc_calls(daemon, "Release") == 1
            assert (await client.stats()).active_leases == 0
