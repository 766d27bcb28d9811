"""Pins and invalidation through a real daemon: tenants over TCP, a restart over Unix."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvstore.client import NO_RETRY, AsyncClient
from kvstore.config import QuotaConfig
from kvstore.errors import CapacityError, InvalidArgument, PermissionDenied
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import small_config

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}


def client(address: str, token: str | None = None) -> AsyncClient:
    return AsyncClient(address, token=token, retry=NO_RETRY)


@pytest.fixture
async def tcp_daemon(root):
    config = small_config(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS,
                          admin_token="tok-admin")
    d = await serve(dataclasses.replace(config, quota=QuotaConfig(pin_bytes=25_000)))
    yield d
    await d.stop(1.0)


async def test_a_tenant_cannot_pin_unpin_or_see_another_tenants_pins(tcp_daemon, ns, spec):
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(64)
    address = tcp_daemon.tcp_address
    async with client(address, "tok-acme") as acme, client(address, "tok-zeta") as zeta, \
            client(address, "tok-admin") as admin:
        await acme.put(ns, tokens, random_kv(spec, 64))
        await zeta.put(zeta_ns, tokens, random_kv(spec, 64))
        mine = await acme.pin(ns, tokens, 600)
        assert (mine.tenant, mine.num_blocks) == ("acme", 4)
        for call in (zeta.pin(ns, tokens, 600), zeta.unpin(ns, tokens),
                     zeta.list_pins(tenant="acme")):
            with pytest.raises(PermissionDenied, match="tenant 'zeta' may not"):
                await call
        assert await zeta.list_pins() == []
        assert (await zeta.pin(zeta_ns, tokens, 600)).tenant == "zeta"  # its own blocks
        assert await zeta.unpin(zeta_ns, tokens) == 1
        assert [p.key for p in await acme.list_pins()] == [mine.key]
        assert {p.tenant for p in await admin.list_pins()} == {"acme"}


async def test_a_pin_over_the_budget_is_refused_with_the_numbers(tcp_daemon, ns, spec):
    async with client(tcp_daemon.tcp_address, "tok-acme") as acme:
        first, second = random_tokens(64, seed=1), random_tokens(64, seed=2)
        await acme.put(ns, first, random_kv(spec, 64))
        await acme.put(ns, second, random_kv(spec, 64))
        pinned = (await acme.pin(ns, first, 600)).size_bytes
        with pytest.raises(CapacityError, match=rf"acme' has {pinned} bytes pinned of its "
                                                r"25000-byte pin budget") as info:
            await acme.pin(ns, second, 600)
        assert "asks" in str(info.value)
        with pytest.raises(InvalidArgument, match="ttl_s"):
            await acme.pin(ns, second, float("nan"))
        assert len(await acme.list_pins()) == 1  # the daemon kept serving


async def test_evict_by_revision_is_immediate_and_scoped_to_the_callers_tenant(
        tcp_daemon, ns, spec):
    r2 = dataclasses.replace(ns, revision="r2")
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(64, seed=3)
    address = tcp_daemon.tcp_address
    async with client(address, "tok-acme") as acme, client(address, "tok-zeta") as zeta:
        await acme.put(ns, tokens, random_kv(spec, 64))
        await acme.put(r2, tokens, random_kv(spec, 64))
        await zeta.put(zeta_ns, tokens, random_kv(spec, 64))  # revision r1 too
        await acme.pin(ns, tokens, 600)
        assert await acme.evict(revision="r1") == 4
        assert (await acme.lookup(ns, tokens)).matched_tokens == 0
        assert (await acme.lookup(r2, tokens)).matched_tokens == 64
        assert (await zeta.lookup(zeta_ns, tokens)).matched_tokens == 64  # not acme's to drop
        assert await acme.list_pins() == []
        # What an engine's reset-cache hook calls: the model's blocks of that revision.
        assert await acme.invalidate(r2) == 4
        assert (await acme.lookup(r2, tokens)).matched_tokens == 0
        with pytest.raises(InvalidArgument, match="namespace fingerprint"):
            await acme._unary(_raw_evict(b"short"))


def _raw_evict(namespace: bytes):
    from kvstore.client.requests import Unary

    return Unary("Evict", pb.EvictRequest(namespace=namespace), lambda r: r.num_blocks)


async def test_pins_survive_a_daemon_restart(config, ns, spec):
    tokens = random_tokens(96, seed=4)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address) as c:
            await c.put(ns, tokens, random_kv(spec, 96))
            await c.pin(ns, tokens, 600)
    finally:
        await daemon.stop(1.0)
    daemon = await serve(config)
    try:
        async with AsyncClient(daemon.unix_address) as c:
            pins = await c.list_pins()
            assert [(p.tenant, p.num_blocks) for p in pins] == [("acme", 6)]
            assert 0 < pins[0].expires_in_s <= 600
            assert await c.evict(tenant="acme") == 0  # ordinary evict leaves pinned blocks
            assert (await c.lookup(ns, tokens)).matched_tokens == 96
            await c.pin(ns, tokens, 0.2)
            for _ in range(400):  # poll: the pin ends at its deadline
                if not await c.list_pins():
                    break
                await asyncio.sleep(0.05)
            assert await c.list_pins() == []
            assert await c.evict(tenant="acme") == 6
    finally:
        await daemon.stop(1.0)
