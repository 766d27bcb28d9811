"""KV events out of the daemon: the store's event sink drained into vLLM-format batches on ZMQ
and into tenant-filtered batches for ``SubscribeEvents`` streams.

The store queues one ``BlockEvent`` per block a tier gains or loses (``store/events.py``). On
the loop turn after the first lands, the hub drains the queue and turns runs of them into
events: a stored chain in one tier (parent to child, one namespace) becomes one ``BlockStored``
with its keys in order, as vLLM sends a request's new blocks; removals from one tier, one
``BlockRemoved``.

The vLLM format (``vllm/distributed/kv_events.py``): a batch is the msgpack array ``[ts,
events, data_parallel_rank]``, each event a tagged array ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved",
block_hashes, medium]`` or ``["AllBlocksCleared"]`` (msgspec ``array_like`` structs with
``tag=True``: the form vLLM up to 0.23, SGLang, llm-d and Dynamo all decode). A block's hash is
its kvstore key: by default the key's low 64 bits as an unsigned int (vLLM's int hashes, and
what llm-d makes of a bytes hash), or its 16 bytes (``events.block_hash = "bytes"``).
``token_ids`` are the block's tokens where the store had them (a put or a reservation's
commit: the tier a block is first written to), else empty, as vLLM's offloading connector
sends for blocks it moves; ``block_size`` is the namespace's tokens per block with them, 0
without (so ``len(token_ids) == len(block_hashes) * block_size`` always holds).

Nothing blocks the loop: ZMQ batches go to a bounded queue for the publisher's thread
(``zmq_publisher.py``); each subscriber has a bounded queue of batches; a full queue drops the
batch and counts it (``kvstore_events_dropped_total``), and a subscriber learns how many of
its events were dropped from ``num_dropped`` in the next batch it gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.config import EventsConfig
from kvstore.errors import CapacityError
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.server.event_runs import EventRun, event_runs, hash_format, run_tokens
from kvstore.server.zmq_publisher import ZmqPublisher
from kvstore.store.events import EventKind, EventSink

_PB_KINDS = {EventKind.STORED: pb.KV_EVENT_STORED, EventKind.REMOVED: pb.KV_EVENT_REMOVED,
             EventKind.CLEARED: pb.KV_EVENT_ALL_CLEARED}


def run_to_proto(run: EventRun) -> pb.KVEvent:
    first, meta = run.first, run.first.meta
    if meta is None:
        return pb.KVEvent(kind=_PB_KINDS[first.kind])
    tokens = run_tokens(run)
    return pb.KVEvent(
        kind=_PB_KINDS[first.kind], keys=run.keys, parent=meta.parent or b"",
        tokens=b"" if tokens is None else tokens.astype("<u4").tobytes(),
        block_tokens=first.block_tokens, first_block_index=meta.block_index,
        tier=first.tier, medium=first.medium, tenant=meta.tenant, model_id=meta.model_id,
        namespace=meta.namespace)


class Subscription:
    """One ``SubscribeEvents`` stream: the batches it has not taken yet, bounded."""

    def __init__(self, tenant: str | None, max_batches: int) -> None:
        self.tenant = tenant  # None: every tenant's events
        self._queue: asyncio.Queue[pb.KVEventBatch] = asyncio.Queue(max_batches)
        self.num_dropped = 0  # events dropped for this subscriber since it subscribed
        self._seq = 0

    def offer(self, events: list[pb.KVEvent], ts: float, host: str) -> bool:
        """Queue a batch of ``events`` (False, counted, when the subscriber is too far behind)."""
        if self._queue.full():
            self.num_dropped += len(events)
            return False
        self._queue.put_nowait(pb.KVEventBatch(ts=ts, seq=self._seq, events=events, host=host,
                                               num_dropped=self.num_dropped))
        self._seq += 1
        return True

    async def next(self, timeout_s: float) -> pb.KVEventBatch | None:
        """The next batch, or None when none came within ``timeout_s``."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            return None


class EventHub:
    """Drains the store's ``EventSink`` on the loop into ZMQ and the gRPC subscriptions.

    Args:
        sink: the store's event sink.
        config: the ``[events]`` settings.
    """

    def __init__(self, sink: EventSink, config: EventsConfig) -> None:
        self._sink = sink
        self._config = config
        self.host = config.host or socket.gethostname()
        self._hash = hash_format(config.block_hash)
        self._subs: set[Subscription] = set()
        self._zmq: ZmqPublisher | None = None
        self._encoder: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self.num_batches = 0  # batches made
        self.num_dropped_by_subscribers = 0  # events dropped for slow subscribers

    @property
    def zmq(self) -> ZmqPublisher | None:
        return self._zmq

    def start(self) -> None:
        """Open the ZMQ sockets if configured (ConfigError if they cannot be) and start
        draining the sink (events queued since the store opened go first)."""
        if self._config.zmq_endpoint:
            from kvstore.server import vllm_events  # msgspec: only with the ZMQ output

            self._encoder = vllm_events.BatchEncoder(self._config, self._hash)
            topic = self._config.topic.replace("{host}", self.host).encode()
            self._zmq = ZmqPublisher(self._config, topic)
            self._zmq.start()
        self._loop = asyncio.get_running_loop()
        self._sink.set_listener(self._schedule)
        self._schedule()

    async def aclose(self) -> None:
        """Stop draining, hand what the sink holds to ZMQ and stop its thread. Idempotent."""
        self._sink.set_listener(None)
        if self._loop is not None:
            self._drain()
            self._loop = None
        if self._zmq is not None:
            await asyncio.to_thread(self._zmq.close)

    @contextlib.contextmanager
    def subscribe(self, tenant: str | None) -> Iterator[Subscription]:
        """A subscription to ``tenant``'s events (None: every tenant's) while in the block.

        Raises:
            CapacityError: ``events.max_subscribers`` streams are open already, or
                ``events.max_subscribers_per_tenant`` of ``tenant``'s.
        """
        config = self._config
        if len(self._subs) >= config.max_subscribers:
            raise CapacityError(f"{len(self._subs)} event subscriptions are open, the most "
                                f"this daemon serves (events.max_subscribers)")
        # One tenant cannot take every subscription from the others.
        if sum(s.tenant == tenant for s in self._subs) >= config.max_subscribers_per_tenant:
            raise CapacityError(f"{config.max_subscribers_per_tenant} event subscriptions of "
                                f"this tenant are open, the most one tenant may hold "
                                f"(events.max_subscribers_per_tenant)")
        sub = Subscription(tenant, self._config.subscriber_queue_batches)
        self._subs.add(sub)
        try:
            yield sub
        finally:
            self._subs.discard(sub)

    # ------------------------------------------------------------------------- draining

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        while events := self._sink.drain(self._config.max_batch_events):
            self._publish(event_runs(events), len(events))

    def _publish(self, runs: list[EventRun], num_events: int) -> None:
        ts = time.time()
        self.num_batches += 1
        if self._zmq is not None:
            self._zmq.offer(self._encoder.encode(ts, runs), num_events)
        if not self._subs:
            return
        by_tenant: dict[str | None, list[pb.KVEvent]] = {}
        everyone: list[pb.KVEvent] = []
        for run in runs:
            event = run_to_proto(run)
            everyone.append(event)
            by_tenant.setdefault(run.first.tenant, []).append(event)
        cleared = by_tenant.pop(None, [])  # the store emptied: every tenant's news
        for sub in list(self._subs):
            events = everyone if sub.tenant is None else by_tenant.get(sub.tenant, []) + cleared
            if events and not sub.offer(events, ts, self.host):
                self.num_dropped_by_subscribers += len(events)


class EventsCollector(Collector):
    """The hub's counters for Prometheus."""

    def __init__(self, hub: EventHub, sink: EventSink) -> None:
        self._hub = hub
        self._sink = sink

    def collect(self) -> Iterator[Metric]:
        hub, zmq = self._hub, self._hub.zmq
        yield CounterMetricFamily("kvstore_events", "KV events the store emitted.",
                                  value=float(self._sink.num_events))
        dropped = CounterMetricFamily(
            "kvstore_events_dropped", "KV events dropped rather than wait: the store's queue "
            "full (store), the ZMQ thread behind (zmq), a subscriber behind (subscriber).",
            labels=["where"])
        dropped.add_metric(["store"], float(self._sink.num_dropped))
        dropped.add_metric(["zmq"], float(zmq.num_dropped_events if zmq else 0))
        dropped.add_metric(["subscriber"], float(hub.num_dropped_by_subscribers))
        yield dropped
        yield CounterMetricFamily("kvstore_events_zmq_batches", "Batches sent on the ZMQ "
                                  "PUB socket.", value=float(zmq.num_sent if zmq else 0))
        yield GaugeMetricFamily("kvstore_events_subscribers", "SubscribeEvents streams open.",
                                value=float(len(hub._subs)))
