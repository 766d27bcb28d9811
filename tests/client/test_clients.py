"""Client and AsyncClient: addresses, round trips inline and through shared memory, value
types and errors mapped back to the kvstore exception tree."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kvstore.api import LookupResult, StoreStats
from kvstore.client import AsyncClient, Client, HealthInfo, default_address
from kvstore.client.address import Target, parse_address
from kvstore.errors import InvalidArgument, LeaseNotFound, PermissionDenied
from tests.server.helpers import DaemonThread, small_config

from ..conftest import random_kv, random_tokens


def test_parse_address():
    assert parse_address("unix:///run/kv.sock") == Target("unix:///run/kv.sock", True)
    assert parse_address("/run/kv.sock").grpc_target == "unix:///run/kv.sock"
    assert parse_address("127.0.0.1:7070") == Target("127.0.0.1:7070", False)
    assert parse_address("[::1]:7070").is_unix is False
    assert parse_address(None).grpc_target == default_address()
    for bad in ("localhost", "host:0", "host:http", ":80"):
        with pytest.raises(InvalidArgument, match="address"):
            parse_address(bad)


@pytest.mark.parametrize("zero_copy", [False, True])
def test_sync_client_round_trip(config, ns, spec, zero_copy):
    tokens, kv = random_tokens(70), random_kv(spec, 70)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        assert isinstance(client.health(), HealthInfo)
        assert client.put(ns, tokens, kv, zero_copy=zero_copy) == 64
        result = client.lookup(ns, tokens)
        assert isinstance(result, LookupResult) and result.matched_tokens == 64
        got = client.get(ns, tokens, zero_copy=zero_copy)
        assert torch.equal(got, kv[:, :, :64])
        assert client.get(ns, random_tokens(32, seed=3), zero_copy=zero_copy) is None
        stats = client.stats()
        assert isinstance(stats, StoreStats) and stats.num_blocks == 4
        assert [b.block_index for b in client.list_blocks(limit=2)] != []
        assert client.hint(ns, tokens, 0.5) == 0
        assert client.evict(model_id=ns.model_id) == 4


def test_sync_client_errors(config, ns, spec):
    with DaemonThread(config) as daemon, Client(daemon.unix_address, token=None) as client:
        with pytest.raises(LeaseNotFound):
            client.release("missing")
        with pytest.raises(InvalidArgument, match="kv dtype"):
            client.put(ns, random_tokens(16), random_kv(spec, 16).half(), zero_copy=False)
        bad_ns = dataclasses.replace(ns, spec=dataclasses.replace(spec, head_dim=8))
        with pytest.raises(InvalidArgument, match="shape"):
            client.put(bad_ns, random_tokens(16), random_kv(spec, 16), zero_copy=False)


def test_sync_client_tenant_token(root, ns):
    config = small_config(root, tenant_tokens={"zeta": "tok-zeta"})
    with DaemonThread(config) as daemon, Client(daemon.unix_address, token="tok-zeta") as c:
        assert c.health().tenant == "zeta"
        with pytest.raises(PermissionDenied, match="'zeta' may not look up"):
            c.lookup(ns, random_tokens(16))


async def test_async_clients_concurrently(aclient, daemon, ns, spec):
    prompts = [(random_tokens(48, seed=i), random_kv(spec, 48, seed=i)) for i in range(8)]
    written = await asyncio.gather(*(aclient.put(ns, t, kv, zero_copy=i % 2 == 0)
                                     for i, (t, kv) in enumerate(prompts)))
    assert written == [48] * 8
    async with AsyncClient(daemon.unix_address, zero_copy=False) as inline:
        got = await asyncio.gather(*(inline.get(ns, t) for t, _ in prompts))
    assert all(torch.equal(g, kv) for g, (_, kv) in zip(got, prompts))
    shared = await asyncio.gather(*(aclient.get(ns, t, zero_copy=True) for t, _ in prompts))
    assert all(torch.equal(g, kv) for g, (_, kv) in zip(shared, prompts))
