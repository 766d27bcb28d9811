"""``subscribe_events`` on both clients against a real daemon with KV events on: a put's stored
event arrives typed (keys, parent, tokens, tier), a tenant's subscription never carries another
tenant's blocks, closing a subscription ends its stream on the daemon, and refusals raise the
kvstore exceptions the other verbs raise."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.api import KVEvent, KVEventBatch, KVEventKind
from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.client.events import AsyncEventStream, EventStream
from kvstore.config import EventsConfig
from kvstore.errors import CapacityError, FailedPrecondition, PermissionDenied
from kvstore.keys import Namespace, block_keys
from kvstore.server.daemon import DaemonThread
from tests.server.helpers import small_config, wait_for

from ..conftest import random_kv, random_tokens

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}
STORED, REMOVED = KVEventKind.STORED, KVEventKind.REMOVED
Done = Callable[[list[KVEvent]], bool]


@pytest.fixture
def events_daemon(root):
    config = dataclasses.replace(
        small_config(root / "events", tenant_tokens=TOKENS, admin_token="tok-admin"),
        events=EventsConfig(enabled=True, zmq_endpoint="", max_subscribers_per_tenant=1))
    with DaemonThread(config) as daemon:
        yield daemon


def subscribers(daemon) -> int:
    return int(daemon.metrics.registry.get_sample_value("kvstore_events_subscribers") or 0)


def read_until(stream: EventStream, done: Done, timeout_s: float = 10.0) -> list[KVEvent]:
    """``stream``'s events until ``done(events)``. A timer closes the stream after
    ``timeout_s``, so a missing event fails the test instead of hanging it."""
    events: list[KVEvent] = []
    timer = threading.Timer(timeout_s, stream.close)
    timer.start()
    try:
        for batch in stream:
            check_batch(batch)
            events.extend(batch.events)
            if done(events):
                return events
    finally:
        timer.cancel()
    raise AssertionError(f"the stream ended before the events came: {events}")


async def aread_until(stream: AsyncEventStream, done: Done, timeout_s: float = 10.0
                      ) -> list[KVEvent]:
    events: list[KVEvent] = []
    async with asyncio.timeout(timeout_s):
        async for batch in stream:
            check_batch(batch)
            events.extend(batch.events)
            if done(events):
                return events
    raise AssertionError(f"the stream ended before the events came: {events}")


def check_batch(batch: KVEventBatch) -> None:
    assert isinstance(batch, KVEventBatch) and isinstance(batch.events, tuple)
    assert batch.host and batch.num_dropped == 0 and batch.ts > 0


def has_stored(count: int) -> Done:
    return lambda events: sum(e.kind is STORED for e in events) >= count


def check_stored(event: KVEvent, ns: Namespace, tokens: list[int], first_block: int = 0
                 ) -> None:
    """``event`` is the stored event of the blocks of ``tokens`` from ``first_block`` on."""
    keys = block_keys(ns, tokens)
    assert event.keys == tuple(keys[first_block:])
    assert event.parent == (keys[first_block - 1] if first_block else None)
    assert event.tokens is not None and event.tokens.dtype == np.uint32
    assert event.tokens.tolist() == tokens[first_block * 16:]
    assert (event.tier, event.medium, event.block_tokens) == ("dram", "CPU", 16)
    assert event.first_block_index == first_block
    assert (event.tenant, event.model_id, event.namespace) == ("acme", ns.model_id,
                                                                ns.fingerprint)


def test_sync_subscriber_gets_a_puts_stored_event(events_daemon, ns, spec):
    tokens = random_tokens(48)
    longer = tokens + random_tokens(32, seed=1)
    with Client(events_daemon.unix_address, token="tok-acme", retry=NO_RETRY) as client:
        with client.subscribe_events() as stream:
            # no wait for the daemon: subscribe_events returned once it was subscribed
            assert client.put(ns, tokens, random_kv(spec, 48)) == 48
            assert client.put(ns, longer, random_kv(spec, 80)) == 32  # two blocks more
            events = read_until(stream, has_stored(2))
        first, grown = [e for e in events if e.kind is STORED]
        check_stored(first, ns, tokens)
        check_stored(grown, ns, longer, first_block=3)
        assert wait_for(lambda: subscribers(events_daemon) == 0)  # closing ended the stream
        assert list(stream) == []  # a closed subscription yields nothing more


async def test_async_subscriber_gets_a_puts_stored_event(events_daemon, ns, spec):
    tokens = random_tokens(48)
    longer = tokens + random_tokens(32, seed=1)
    async with AsyncClient(events_daemon.unix_address, token="tok-acme",
                           retry=NO_RETRY) as client:
        async with await client.subscribe_events() as stream:
            assert await client.put(ns, tokens, random_kv(spec, 48)) == 48
            assert await client.put(ns, longer, random_kv(spec, 80)) == 32
            events = await aread_until(stream, has_stored(2))
        first, grown = [e for e in events if e.kind is STORED]
        check_stored(first, ns, tokens)
        check_stored(grown, ns, longer, first_block=3)
        await until(lambda: subscribers(events_daemon) == 0)
        assert [b async for b in stream] == []


def acme_removed(keys: set) -> Done:
    return lambda events: {k for e in events if e.kind is REMOVED for k in e.keys} >= keys


def test_sync_a_tenants_subscription_never_sees_another_tenants_blocks(events_daemon, ns,
                                                                       spec):
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(48)
    acme_keys, zeta_keys = set(block_keys(ns, tokens)), set(block_keys(zeta_ns, tokens))
    address = events_daemon.unix_address
    with Client(address, token="tok-acme", retry=NO_RETRY) as acme, \
            Client(address, token="tok-zeta", retry=NO_RETRY) as zeta, \
            Client(address, token="tok-admin", retry=NO_RETRY) as admin, \
            acme.subscribe_events() as mine, admin.subscribe_events() as everyone:
        zeta.put(zeta_ns, tokens, random_kv(spec, 48))  # first: acme's stream must skip it
        acme.put(ns, tokens, random_kv(spec, 48))
        zeta.evict(keys=list(zeta_keys))
        acme.evict(keys=list(acme_keys))
        seen = read_until(mine, acme_removed(acme_keys))
        assert {e.tenant for e in seen} == {"acme"}
        assert not {k for e in seen for k in e.keys} & zeta_keys
        # the admin's subscription carries both tenants' blocks
        read_until(everyone, lambda events: {e.tenant for e in events} == {"acme", "zeta"})


async def test_async_a_tenants_subscription_never_sees_another_tenants_blocks(events_daemon,
                                                                              ns, spec):
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(48)
    acme_keys, zeta_keys = set(block_keys(ns, tokens)), set(block_keys(zeta_ns, tokens))
    address = events_daemon.unix_address
    async with AsyncClient(address, token="tok-acme", retry=NO_RETRY) as acme, \
            AsyncClient(address, token="tok-zeta", retry=NO_RETRY) as zeta:
        async with await acme.subscribe_events() as mine:
            await zeta.put(zeta_ns, tokens, random_kv(spec, 48))
            await acme.put(ns, tokens, random_kv(spec, 48))
            await zeta.evict(keys=list(zeta_keys))
            await acme.evict(keys=list(acme_keys))
            seen = await aread_until(mine, acme_removed(acme_keys))
        assert {e.tenant for e in seen} == {"acme"}
        assert not {k for e in seen for k in e.keys} & zeta_keys


def test_sync_refusals_raise_kvstore_errors(events_daemon, root):
    with Client(events_daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
        with pytest.raises(PermissionDenied):
            acme.subscribe_events("zeta")
        first = acme.subscribe_events()
        with pytest.raises(CapacityError, match="max_subscribers_per_tenant"):
            acme.subscribe_events()  # one per tenant on this daemon
        first.close()  # cancels the stream: the daemon frees its place
        assert wait_for(lambda: subscribers(events_daemon) == 0)
        acme.subscribe_events().close()
    with DaemonThread(small_config(root / "off")) as off, Client(off.unix_address) as client, \
            pytest.raises(FailedPrecondition, match="events.enabled"):
        client.subscribe_events()


async def test_async_refusals_raise_kvstore_errors(events_daemon, daemon):
    async with AsyncClient(events_daemon.unix_address, token="tok-acme",
                           retry=NO_RETRY) as acme:
        with pytest.raises(PermissionDenied):
            await acme.subscribe_events("zeta")
        first = await acme.subscribe_events()
        with pytest.raises(CapacityError, match="max_subscribers_per_tenant"):
            await acme.subscribe_events()
        await first.aclose()
        await until(lambda: subscribers(events_daemon) == 0)
        await (await acme.subscribe_events()).aclose()
    async with AsyncClient(daemon.unix_address) as client:  # events off on this one
        with pytest.raises(FailedPrecondition, match="events.enabled"):
            await client.subscribe_events()


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)
