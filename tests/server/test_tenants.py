"""Tenant isolation over TCP on 127.0.0.1 with bearer tokens, and the Unix-socket rules."""

from __future__ import annotations

import dataclasses

import pytest

from kvstore.client import NO_RETRY, AsyncClient, requests
from kvstore.errors import ConfigError, InvalidArgument, PermissionDenied, Unauthenticated
from kvstore.keys import block_keys
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import small_config

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}


@pytest.fixture
async def tcp_daemon(root):
    config = small_config(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS,
                          admin_token="tok-admin")
    d = await serve(config)
    yield d
    await d.stop(1.0)


def client(address: str, token: str | None = None) -> AsyncClient:
    return AsyncClient(address, token=token, retry=NO_RETRY)


async def test_tenant_isolation_over_tcp(tcp_daemon, ns, spec):
    assert tcp_daemon.tcp_port and tcp_daemon.tcp_address.startswith("127.0.0.1:")
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(48)
    async with client(tcp_daemon.tcp_address, "tok-acme") as acme, \
            client(tcp_daemon.tcp_address, "tok-zeta") as zeta, \
            client(tcp_daemon.tcp_address, "tok-admin") as admin:
        assert (await acme.health()).tenant == "acme"
        assert await acme.put(ns, tokens, random_kv(spec, 48)) == 48
        assert await zeta.put(zeta_ns, tokens[:32], random_kv(spec, 32)) == 32

        denied = "tenant 'acme' may not"
        for call in (acme.lookup(zeta_ns, tokens), acme.get(zeta_ns, tokens),
                     acme.put(zeta_ns, tokens, random_kv(spec, 48)),
                     acme.hint(zeta_ns, tokens, 1.0), acme.cancel_hint(zeta_ns, tokens),
                     acme.acquire(zeta_ns, tokens),
                     acme.list_blocks(tenant="zeta"), acme.stats(tenant="zeta"),
                     acme.evict(tenant="zeta")):
            with pytest.raises(PermissionDenied, match=denied):
                await call

        mine = await acme.list_blocks()
        assert len(mine) == 3 and {b.tenant for b in mine} == {"acme"}
        stats = await acme.stats()
        assert stats.num_blocks == 3 and stats.counters.puts == 1
        assert stats.tiers["dram"].num_blocks == 3
        assert len(await admin.list_blocks()) == 5
        assert (await admin.stats()).num_blocks == 5
        assert (await admin.stats(tenant="zeta")).num_blocks == 2

        # another tenant's keys are simply not acme's to evict: nothing happens to them
        assert await acme.evict(keys=block_keys(zeta_ns, tokens[:32])) == 0
        assert (await zeta.lookup(zeta_ns, tokens)).matched_tokens == 32
        assert await acme.evict(everything=True) == 3  # a tenant's "everything" is its own
        assert (await zeta.lookup(zeta_ns, tokens)).matched_tokens == 32

        # leases are only granted on the Unix socket (tests/security/test_request_limits.py);
        # a token binds there too, and the owner check holds across transports (while the
        # lease's client is open: its session ending would give the lease back)
        async with client(tcp_daemon.unix_address, "tok-zeta") as zeta_local:
            lease = await zeta_local.acquire(zeta_ns, tokens)
            with pytest.raises(PermissionDenied, match="another tenant"):
                await acme.release(lease.lease_id)
            await zeta.release(lease.lease_id)
        assert await admin.evict(tenant="zeta") == 2


async def test_another_tenant_cannot_abort_a_reservation(tcp_daemon, ns, spec):
    """Abort applies Commit's owner check: zeta can neither abort nor commit acme's slots.
    Reservations are only granted on the Unix socket, where the tokens bind the same way."""
    tokens = random_tokens(32, seed=9)
    async with client(tcp_daemon.unix_address, "tok-acme") as acme, \
            client(tcp_daemon.tcp_address, "tok-zeta") as zeta, \
            client(tcp_daemon.tcp_address, "tok-admin") as admin:
        reservation = await acme.reserve(ns, tokens)
        assert len(reservation.blocks) == 2
        for call in (zeta.abort, zeta.commit):
            with pytest.raises(PermissionDenied, match="another tenant"):
                await call(reservation.reservation_id)
        assert (await admin.stats()).active_reservations == 1  # still acme's, untouched
        await acme.abort(reservation.reservation_id)
        assert (await admin.stats()).active_reservations == 0
        assert await acme.put(ns, tokens, random_kv(spec, 32)) == 32


async def test_tcp_requires_a_valid_token(tcp_daemon, ns):
    for token, match in ((None, "bearer token is required over TCP"),
                         ("wrong", "matches no tenant")):
        async with client(tcp_daemon.tcp_address, token) as anonymous:
            with pytest.raises(Unauthenticated, match=match):
                await anonymous.lookup(ns, random_tokens(16))
            with pytest.raises(Unauthenticated):
                await anonymous.get(ns, random_tokens(16))


async def test_unix_socket_local_trust(tcp_daemon, ns, spec):
    """No token on the Unix socket: the namespace's tenant, and admin listing rights."""
    async with client(tcp_daemon.unix_address) as local:
        zeta_ns = dataclasses.replace(ns, tenant="zeta")
        assert await local.put(zeta_ns, random_tokens(16), random_kv(spec, 16)) == 16
        health = await local.health()
        assert health.is_admin and health.tenant == ""
        assert len(await local.list_blocks()) == 1
    async with client(tcp_daemon.unix_address, "tok-acme") as acme:  # a token still binds
        with pytest.raises(PermissionDenied):
            await acme.lookup(zeta_ns, random_tokens(16))


async def test_require_auth_on_unix(root, ns):
    d = await serve(small_config(root, tenant_tokens=TOKENS, require_auth_on_unix=True))
    try:
        async with client(d.unix_address) as anonymous:
            with pytest.raises(Unauthenticated, match="require_auth_on_unix"):
                await anonymous.health()
        async with client(d.unix_address, "tok-acme") as acme:
            assert (await acme.lookup(ns, random_tokens(16))).matched_tokens == 0
    finally:
        await d.stop(1.0)


async def test_tcp_without_tokens_is_refused_at_start(root):
    with pytest.raises(ConfigError, match="without tokens"):
        await serve(small_config(root, tcp_address="127.0.0.1:0"))


async def test_an_acquire_cannot_carry_another_tenants_lease(tcp_daemon, ns, spec):
    """Releases riding on an Acquire or Reserve pass Release's owner check: acme naming zeta's
    lease is refused, and zeta's lease stays held; too many ids are refused by name."""
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(32, seed=11)
    async with client(tcp_daemon.unix_address, "tok-acme") as acme, \
            client(tcp_daemon.unix_address, "tok-zeta") as zeta, \
            client(tcp_daemon.tcp_address, "tok-admin") as admin:
        await acme.put(ns, tokens, random_kv(spec, 32))
        await zeta.put(zeta_ns, tokens, random_kv(spec, 32))
        lease = await zeta.acquire(zeta_ns, tokens)
        for carrying in (requests.acquire(ns, tokens, None, release=[lease.lease_id]),
                         requests.reserve(ns, random_tokens(32, seed=12), None,
                                          release=[lease.lease_id])):
            with pytest.raises(PermissionDenied, match="another tenant"):
                await acme._unary(carrying)
        assert (await admin.stats()).active_leases == 1  # zeta's, untouched
        with pytest.raises(InvalidArgument, match="at most 64 leases to release, got 65"):
            await acme._unary(requests.acquire(ns, tokens, None, release=["x"] * 65))
        # ids of leases that are gone are not an error: they were released already
        mine, released = await acme._unary(requests.acquire(ns, tokens, None,
                                                            release=["gone-1", "gone-2"]))
        assert released == 2 and mine.matched_tokens == 32
        await acme.release(mine.lease_id)
        await zeta.release(lease.lease_id)
        assert (await admin.stats()).active_leases == 0
