"""KV events from a real daemon: vLLM's ZMQ wire read by a real SUB socket and decoded with
structs defined here as vLLM defines them, replay by sequence, the tenant-filtered gRPC stream,
and subscribers that never read."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc
import msgspec
import pytest
import zmq

from kvstore.client import NO_RETRY, AsyncClient, Client
from kvstore.config import EventsConfig
from kvstore.keys import block_keys
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc import kvstore_pb2_grpc as pbg
from kvstore.rpc.convert import tokens_to_bytes
from kvstore.server.daemon import DaemonThread, serve

from ..conftest import random_kv, random_tokens
from .helpers import MiB, small_config, wait_for

TOKENS = {"acme": "tok-acme", "zeta": "tok-zeta"}


# vLLM's classes (vllm/distributed/kv_events.py), as a router that consumes them defines them.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def vllm_hash(key: bytes) -> int:
    """What vLLM's int block hashes are made of a hash's bytes: its low 64 bits."""
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def events_config(root, **fields) -> EventsConfig:
    return EventsConfig(enabled=True, zmq_endpoint=f"ipc://{root}/events.pub",
                        replay_endpoint=f"ipc://{root}/events.replay", **fields)


class Subscriber:
    """A ZMQ SUB socket on the daemon's PUB endpoint, collecting (seq, batch)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.received: list[tuple[int, KVEventBatch]] = []
        self.topics: set[bytes] = set()

    def take(self, timeout_s: float = 0.2) -> int:
        """Receive what arrives within ``timeout_s``; how many messages came."""
        count = 0
        while self.sock.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            assert len(seq) == 8
            self.topics.add(topic)
            self.received.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
            count += 1
        return count

    def events(self) -> list[Any]:
        return [e for _, batch in self.received for e in batch.events]

    def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:
        return wait_for(lambda: self.take(0.05) >= 0 and predicate(self.events()), timeout_s)


def join(client: Client, ns, sub: Subscriber, spec) -> None:
    """Put throwaway prefixes until the SUB socket gets messages (ZMQ's slow joiner)."""
    for seed in range(100, 200):
        client.put(dataclasses.replace(ns, model_id="warmup"), random_tokens(16, seed),
                   random_kv(spec, 16))
        if sub.take(0.1):
            return
    raise AssertionError("the SUB socket received nothing")


def test_zmq_subscriber_sees_puts_and_evicts_in_vllm_format(root, ns, spec):
    # llm-d's indexer reads the pod and model from a topic of this form
    events = events_config(root, topic="kv@{host}@test/model", host="node-a")
    config = dataclasses.replace(small_config(root), events=events)
    tokens = random_tokens(48)
    keys = block_keys(ns, tokens)
    hashes = [vllm_hash(k) for k in keys]
    ctx = zmq.Context()
    try:
        with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
            sub = Subscriber(ctx, config.events.zmq_endpoint)
            join(client, ns, sub, spec)
            assert client.put(ns, tokens, random_kv(spec, 48)) == 48

            def stored(events):
                return [e for e in events if isinstance(e, BlockStored)
                        and set(e.block_hashes) & set(hashes)]
            assert sub.wait_for(lambda events: sum(len(e.block_hashes)
                                                   for e in stored(events)) == 3)
            [event] = stored(sub.events())  # one chain: one event, as vLLM sends a request's
            assert event.block_hashes == hashes and event.parent_block_hash is None
            assert event.token_ids == tokens and event.block_size == 16
            assert event.medium == "CPU" and event.lora_id is None

            # the prompt grows by two blocks: only those are stored, chained to what was there
            longer = tokens + random_tokens(32, seed=7)
            more = [vllm_hash(k) for k in block_keys(ns, longer)[3:]]
            assert client.put(ns, longer, random_kv(spec, 80)) == 32
            assert sub.wait_for(lambda events: any(
                isinstance(e, BlockStored) and e.block_hashes == more for e in events))
            [grown] = [e for e in sub.events()
                       if isinstance(e, BlockStored) and e.block_hashes == more]
            assert grown.parent_block_hash == hashes[-1] and grown.token_ids == longer[48:]
            keys = block_keys(ns, longer)
            hashes += more

            assert client.evict(keys=keys) == 5
            assert sub.wait_for(lambda events: {
                h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes
            } >= set(hashes))
            removed = [e for e in sub.events() if isinstance(e, BlockRemoved)]
            assert {e.medium for e in removed} == {"CPU"}
            assert all(batch.data_parallel_rank == 0 for _, batch in sub.received)
            assert sub.topics == {b"kv@node-a@test/model"}

            client.evict(everything=True)  # the store is empty: vLLM's reset of its cache
            assert sub.wait_for(lambda events: isinstance(events[-1], AllBlocksCleared))
            seqs = [seq for seq, _ in sub.received]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    finally:
        ctx.destroy(linger=0)


def test_demotion_is_a_stored_event_below_and_a_removed_one_above(root, ns, spec):
    """A block pushed out of DRAM into the SSD tier: stored in STORAGE (its key and parent,
    no tokens: the store does not keep them), removed from CPU."""
    config = dataclasses.replace(
        small_config(root, dram_bytes=2 * MiB, ssd={"admit_after_accesses": 0}),
        events=events_config(root, block_hash="bytes"))
    ctx = zmq.Context()
    try:
        with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
            sub = Subscriber(ctx, config.events.zmq_endpoint)
            join(client, ns, sub, spec)
            for seed in range(12):  # about twice what the DRAM tier holds
                client.put(ns, random_tokens(1024, seed), random_kv(spec, 1024, seed))

            def moved(events):
                down = {h for e in events if isinstance(e, BlockStored)
                        and e.medium == "STORAGE" for h in e.block_hashes}
                gone = {h for e in events if isinstance(e, BlockRemoved)
                        and e.medium == "CPU" for h in e.block_hashes}
                return down & gone
            assert sub.wait_for(moved)
            key = next(iter(moved(sub.events())))
            assert isinstance(key, bytes) and len(key) == 16  # block_hash = "bytes": whole keys
            below = [e for e in sub.events() if isinstance(e, BlockStored)
                     and e.medium == "STORAGE" and key in e.block_hashes]
            assert below and below[0].token_ids == [] and below[0].block_size == 0
            assert below[0].parent_block_hash is None or len(below[0].parent_block_hash) == 16
    finally:
        ctx.destroy(linger=0)


def test_replay_returns_missed_batches_by_sequence(root, ns, spec):
    config = dataclasses.replace(small_config(root), events=events_config(root))
    ctx = zmq.Context()
    try:
        with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
            sub = Subscriber(ctx, config.events.zmq_endpoint)
            join(client, ns, sub, spec)
            for seed in range(5):
                client.put(ns, random_tokens(32, seed), random_kv(spec, 32, seed))
            assert sub.wait_for(lambda events: len(sub.received) >= 6)
            live = dict(sub.received)
            replay = ctx.socket(zmq.DEALER)
            replay.connect(config.events.replay_endpoint)
            replay.send_multipart([b"", (0).to_bytes(8, "big")])  # everything from seq 0
            replayed = []
            while True:
                assert replay.poll(10_000)
                empty, seq, payload = replay.recv_multipart()
                assert empty == b""
                if seq == (-1).to_bytes(8, "big", signed=True):
                    assert payload == b""
                    break
                replayed.append((int.from_bytes(seq, "big"), payload))
            numbers = [seq for seq, _ in replayed]
            assert numbers == list(range(len(numbers))) and len(numbers) >= len(live)
            # every batch from 0 on, those the SUB socket missed while it joined too; the ones
            # it saw are the same batches
            assert numbers[0] == 0 and set(numbers) >= set(live)
            for seq, payload in replayed:
                if seq in live:
                    assert DECODER.decode(payload) == live[seq]
            # from a later sequence: only what follows it
            start = numbers[-1]
            replay.send_multipart([b"", start.to_bytes(8, "big")])
            empty, seq, _payload = replay.recv_multipart()
            assert int.from_bytes(seq, "big") == start
            assert replay.recv_multipart()[1] == (-1).to_bytes(8, "big", signed=True)
            replay.send_multipart([b"", b"junk"])  # malformed: ignored, the daemon goes on
            client.put(ns, random_tokens(32, 99), random_kv(spec, 32, 99))
            assert sub.wait_for(lambda events: max(live) < max(s for s, _ in sub.received))
    finally:
        ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- gRPC stream


@pytest.fixture
async def tcp_daemon(root):
    config = dataclasses.replace(
        small_config(root, tcp_address="127.0.0.1:0", tenant_tokens=TOKENS,
                     admin_token="tok-admin"),
        events=EventsConfig(enabled=True, zmq_endpoint="", subscriber_queue_batches=8,
                            max_subscribers_per_tenant=1))
    d = await serve(config)
    yield d
    await d.stop(1.0)


def subscribers(daemon) -> int:
    return int(daemon.metrics.registry.get_sample_value("kvstore_events_subscribers") or 0)


def dropped(daemon, where: str) -> float:
    return daemon.metrics.registry.get_sample_value("kvstore_events_dropped_total",
                                                    {"where": where}) or 0.0


async def until(predicate, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return bool(predicate())


def subscribe(channel: grpc.aio.Channel, token: str, tenant: str = ""):
    return pbg.KVStoreStub(channel).SubscribeEvents(
        pb.SubscribeEventsRequest(tenant=tenant),
        metadata=(("authorization", f"Bearer {token}"),))


async def test_grpc_subscriber_sees_only_its_tenants_blocks(tcp_daemon, ns, spec):
    zeta_ns = dataclasses.replace(ns, tenant="zeta")
    tokens = random_tokens(48)
    acme_keys, zeta_keys = set(block_keys(ns, tokens)), set(block_keys(zeta_ns, tokens))
    async with grpc.aio.insecure_channel(tcp_daemon.tcp_address) as channel, \
            AsyncClient(tcp_daemon.tcp_address, token="tok-acme", retry=NO_RETRY) as acme, \
            AsyncClient(tcp_daemon.tcp_address, token="tok-zeta", retry=NO_RETRY) as zeta:
        denied = subscribe(channel, "tok-acme", tenant="zeta")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await denied.read()
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        mine, admin = subscribe(channel, "tok-acme"), subscribe(channel, "tok-admin")
        assert await until(lambda: subscribers(tcp_daemon) == 2)
        second = subscribe(channel, "tok-acme")  # past acme's share of the subscriptions
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await second.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_subscribers_per_tenant" in info.value.details()

        await zeta.put(zeta_ns, tokens, random_kv(spec, 48))  # first: acme must not see it
        await acme.put(ns, tokens, random_kv(spec, 48))
        await zeta.evict(keys=list(zeta_keys))
        await acme.evict(keys=list(acme_keys))

        seen: list[pb.KVEvent] = []
        while {k for e in seen if e.kind == pb.KV_EVENT_REMOVED for k in e.keys} != acme_keys:
            batch = await asyncio.wait_for(mine.read(), 10)
            assert batch.host and batch.num_dropped == 0
            seen.extend(batch.events)
        assert {e.tenant for e in seen} == {"acme"}
        assert not {k for e in seen for k in e.keys} & zeta_keys
        [stored] = [e for e in seen if e.kind == pb.KV_EVENT_STORED]
        assert list(stored.keys) == block_keys(ns, tokens)
        assert stored.tokens == tokens_to_bytes(tokens)
        assert (stored.medium, stored.tier, stored.block_tokens) == ("CPU", "dram", 16)
        assert stored.model_id == ns.model_id and stored.namespace == ns.fingerprint

        everyone: set[str] = set()
        while everyone != {"acme", "zeta"}:
            batch = await asyncio.wait_for(admin.read(), 10)
            everyone |= {e.tenant for e in batch.events}
        mine.cancel()
        admin.cancel()


async def test_a_stalled_subscriber_never_holds_puts_up(tcp_daemon, ns, spec, root):
    """A subscriber that never reads: every put completes and its events are dropped and
    counted, while a subscriber that reads gets every event."""
    # The stalled stream's HTTP/2 window is kept small, so the daemon's writes to it stop soon.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 << 10)]
    async with grpc.aio.insecure_channel(tcp_daemon.tcp_address, options=options) as stalled_ch, \
            grpc.aio.insecure_channel(tcp_daemon.tcp_address) as reader_ch, \
            AsyncClient(tcp_daemon.unix_address, token="tok-acme", retry=NO_RETRY) as acme:
        stalled = subscribe(stalled_ch, "tok-admin")  # never read
        reader = subscribe(reader_ch, "tok-acme")
        assert await until(lambda: subscribers(tcp_daemon) == 2)
        read: list[pb.KVEventBatch] = []

        async def keep_reading():
            async for batch in reader:
                read.append(batch)

        reading = asyncio.create_task(keep_reading())
        stored = set()
        for seed in range(300):
            tokens = random_tokens(256, seed)
            assert await acme.put(ns, tokens, random_kv(spec, 256)) == 256
            stored |= set(block_keys(ns, tokens))
            if dropped(tcp_daemon, "subscriber") and seed > 20:
                break
        assert dropped(tcp_daemon, "subscriber") > 0
        assert (await acme.stats()).counters.puts == seed + 1
        assert await until(lambda: {k for b in read for e in b.events
                                    if e.kind == pb.KV_EVENT_STORED for k in e.keys} == stored)
        assert read[-1].num_dropped == 0
        stalled.cancel()
        reading.cancel()
        assert await until(lambda: subscribers(tcp_daemon) == 0)


async def test_subscribing_without_events_is_refused(daemon):
    async with grpc.aio.insecure_channel(daemon.unix_address) as channel:
        call = pbg.KVStoreStub(channel).SubscribeEvents(pb.SubscribeEventsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "events.enabled" in info.value.details()


def test_events_config_names_what_is_wrong():
    from kvstore.config import load_config
    from kvstore.errors import ConfigError
    from kvstore.store.events import tier_media

    config = load_config(environ={}, overrides={"events": {
        "enabled": "true", "media": "ssd=DISK", "zmq_endpoint": "ipc:///tmp/x.pub"}})
    assert config.events.enabled and config.events.media == {"ssd": "DISK"}
    chain = [(t.name, t.kind) for t in config.tier_chain()]
    assert tier_media(chain + [("hbm", "hbm")], config.events.media) == {
        "dram": "CPU", "ssd": "DISK", "hbm": "GPU"}
    for field, value in (("zmq_mode", "both"), ("block_hash", "str"),
                         ("zmq_endpoint", "localhost:5557"), ("max_subscribers", "0")):
        with pytest.raises(ConfigError, match=f"events.{field}"):
            load_config(environ={}, overrides={"events": {field: value}})


def test_the_example_router_learns_where_a_prompt_is_held(root, ns, spec):
    """examples/kv_event_router.py, driven by a real daemon: it replays what it missed while
    joining and then scores the stored prompt as held whole by this host."""
    import importlib.util
    import threading
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "kv_event_router.py"
    module_spec = importlib.util.spec_from_file_location("kv_event_router", path)
    router = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(router)
    events = events_config(root, topic="kv@{host}@test/model", host="node-a")
    config = dataclasses.replace(small_config(root), events=events)
    tokens = random_tokens(48)
    with DaemonThread(config) as daemon, Client(daemon.unix_address) as client:
        assert client.put(ns, tokens, random_kv(spec, 48)) == 48  # before the router joins
        threading.Thread(target=router.follow, args=(events.zmq_endpoint, events.replay_endpoint),
                         daemon=True).start()
        for seed in range(300, 400):  # live batches, so the router sees its gap and replays
            if router.cached_blocks("node-a", ns, tokens) == 3:
                break
            client.put(dataclasses.replace(ns, model_id="other"), random_tokens(16, seed),
                       random_kv(spec, 16))
            wait_for(lambda: router.cached_blocks("node-a", ns, tokens) == 3, 0.2)
        assert router.cached_blocks("node-a", ns, tokens) == 3
        assert router.cached_blocks("node-b", ns, tokens) == 0
