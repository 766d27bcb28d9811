"""The standard gRPC health service: NOT_SERVING until the store is open and the daemon has
started, SERVING after, NOT_SERVING while draining; Check needs no token, nothing else changes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.cli.health import UNREACHABLE, check
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc
from kvstore.server import daemon as daemon_module
from kvstore.server.auth import Authenticator
from kvstore.server.daemon import Daemon, serve
from kvstore.server.health import KVSTORE_SERVICE, NOT_SERVING, SERVING
from kvstore.server.sockets import claim_socket_path
from kvstore.store import Store

from .helpers import small_config

Status = health_pb2.HealthCheckResponse


async def ask(target: str, service: str = "", metadata=None) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5,
                                 metadata=metadata)
        return reply.status


def test_service_name_is_the_protos():
    assert KVSTORE_SERVICE == "kvstore.v1.KVStore"


async def test_serving_after_start_for_both_names(daemon):
    for service in ("", KVSTORE_SERVICE):
        assert await ask(daemon.unix_address, service) == Status.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ask(daemon.unix_address, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_not_serving_until_started_and_while_draining(config):
    """The health service is on the server from the start but answers NOT_SERVING until
    start() has finished (the store was opened before), and again once stop() begins."""
    lock = claim_socket_path(config.server.socket_path)
    store = Store(config)
    await store.open()
    d = Daemon(config, store, lock, Authenticator(config.server))
    try:
        d._bind()
        await d.server.start()  # the sockets answer; start() has not finished
        assert await ask(d.unix_address) == Status.NOT_SERVING
        assert await ask(d.unix_address, KVSTORE_SERVICE) == Status.NOT_SERVING
        await d.health.serving()
        assert await ask(d.unix_address) == Status.SERVING
    finally:
        stopping = asyncio.create_task(d.stop(1.0))
        await asyncio.sleep(0)  # stop() has set draining before its first wait
        assert d.health.status() == NOT_SERVING
        assert d.health.status(KVSTORE_SERVICE) == NOT_SERVING
        await stopping


async def test_unreachable_while_the_store_opens(config, monkeypatch):
    """Before the tiers are open nothing listens: a probe gets a clear UNREACHABLE."""
    opened = asyncio.Event()
    release = asyncio.Event()
    real_open = Store.open

    async def slow_open(self):
        opened.set()
        await release.wait()
        await real_open(self)

    monkeypatch.setattr(daemon_module.Store, "open", slow_open)
    starting = asyncio.create_task(serve(config))
    await opened.wait()
    address = f"unix://{config.server.socket_path}"
    status, detail = await asyncio.to_thread(check, address, "", 2.0)
    assert status == UNREACHABLE and "not running, or still opening its tiers" in detail
    release.set()
    d = await starting
    try:
        assert d.health.status() == SERVING
        assert await asyncio.to_thread(check, address) == ("SERVING", "")
    finally:
        await d.stop(1.0)


@pytest.fixture
async def guarded(root):
    """A daemon that demands tokens on both the Unix socket and TCP."""
    config = small_config(root, tenant_tokens={"acme": "tok-acme"}, admin_token="tok-admin",
                          require_auth_on_unix=True, tcp_address="127.0.0.1:0")
    d = await serve(config)
    yield d
    await d.stop(1.0)


async def test_check_needs_no_token_other_calls_still_do(guarded: Daemon):
    for target in (guarded.unix_address, guarded.tcp_address):
        assert await ask(target) == Status.SERVING
        assert await ask(target, KVSTORE_SERVICE) == Status.SERVING
        async with grpc.aio.insecure_channel(target) as channel:
            kv = kvstore_pb2_grpc.KVStoreStub(channel)
            for call in (kv.Health(pb.HealthRequest(), timeout=5),
                         kv.Stats(pb.StatsRequest(), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Watch holds a stream open for as long as the caller likes: token required
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watch.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # ... and with one the same calls pass
            auth = (("authorization", "Bearer tok-acme"),)
            reply = await kv.Health(pb.HealthRequest(), timeout=5, metadata=auth)
            assert reply.tenant == "acme"
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=5, metadata=auth)
            assert (await watch.read()).status == Status.SERVING
            watch.cancel()


async def test_a_bad_token_on_check_is_ignored_not_rejected(guarded: Daemon):
    """Check reads no metadata: a probe with a stale token still gets the answer."""
    bad = (("authorization", "Bearer wrong"),)
    assert await ask(guarded.tcp_address, metadata=bad) == Status.SERVING
