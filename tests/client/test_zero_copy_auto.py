"""The default client (``zero_copy`` unset) finds the shared-memory path: on a fresh, empty
daemon at once, and, when its first attempt found no arena, at a later call. Which path a call
took is read from the daemon's per-method RPC counts (Reserve/Commit/Acquire against Put/Get)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvstore.client import AsyncClient, Client, mappings
from tests.server.helpers import DaemonThread, rpc_calls

from ..conftest import random_kv, random_tokens


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(mappings, "_clock", fake)
    return fake


async def test_default_client_on_a_fresh_daemon_uses_shared_memory(daemon, ns, spec):
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    async with AsyncClient(daemon.unix_address) as client:
        assert await client.put(ns, tokens, kv) == 64
        assert (rpc_calls(daemon, "Reserve"), rpc_calls(daemon, "Commit")) == (1, 1)
        assert torch.equal(await client.get(ns, tokens), kv)
        assert rpc_calls(daemon, "Acquire") == 1
    assert (rpc_calls(daemon, "Put"), rpc_calls(daemon, "Get")) == (0, 0)


async def test_a_client_that_found_no_arena_finds_it_later(daemon, ns, spec, clock):
    """Regression: a client decided once, at its first call, whether it could map the arena,
    and kept the socket path for its lifetime when that attempt failed (here the descriptor
    socket is not answering yet, as while a daemon starts)."""
    await daemon.fd_server.close()
    prompts = [(random_tokens(32, seed=i), random_kv(spec, 32, seed=i)) for i in range(4)]
    async with AsyncClient(daemon.unix_address) as client:
        assert await client.put(ns, *prompts[0]) == 32
        assert (rpc_calls(daemon, "Put"), rpc_calls(daemon, "Reserve")) == (1, 0)
        clock.now += mappings.PROBE_RETRY_S / 2  # too soon to ask again: streams, no probe
        assert await client.put(ns, *prompts[1]) == 32
        assert (rpc_calls(daemon, "Put"), rpc_calls(daemon, "Health")) == (2, 1)

        await daemon.fd_server.start()
        clock.now += mappings.PROBE_RETRY_S
        assert await client.put(ns, *prompts[2]) == 32
        assert (rpc_calls(daemon, "Put"), rpc_calls(daemon, "Reserve"), rpc_calls(daemon, "Commit")) \
            == (2, 1, 1)
        assert torch.equal(await client.get(ns, prompts[0][0]), prompts[0][1])
        assert (rpc_calls(daemon, "Acquire"), rpc_calls(daemon, "Get")) == (1, 0)
        assert await client.put(ns, *prompts[3]) == 32  # no further probe once it works
        assert (rpc_calls(daemon, "Health"), rpc_calls(daemon, "Reserve")) == (2, 2)


def test_blocking_client_finds_it_later_too(config, ns, spec, clock):
    """The same for ``Client``, against a daemon in its own thread."""
    tokens, kv = random_tokens(32), random_kv(spec, 32)
    thread = DaemonThread(config)
    with thread as daemon, Client(daemon.unix_address) as client:
        def on_daemon_loop(coro) -> None:
            asyncio.run_coroutine_threadsafe(coro, thread._loop).result(10)

        on_daemon_loop(daemon.fd_server.close())
        assert client.put(ns, tokens, kv) == 32
        assert (rpc_calls(daemon, "Put"), rpc_calls(daemon, "Reserve")) == (1, 0)
        on_daemon_loop(daemon.fd_server.start())
        clock.now += mappings.PROBE_RETRY_S
        assert torch.equal(client.get(ns, tokens), kv)
        assert (rpc_calls(daemon, "Acquire"), rpc_calls(daemon, "Get")) == (1, 0)
