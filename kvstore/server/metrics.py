"""Prometheus metrics: per-RPC latency and errors (an interceptor) and store gauges per tier.

RPC metrics are labelled by method, tenant and model (what the call's record noted,
``server/calls.py``); each of tenant and model keeps its own label for its first
``server.metrics_max_label_values`` distinct values and counts later ones as ``other``.

Everything lives on one private ``CollectorRegistry`` served by prometheus_client's HTTP server
on ``server.metrics_port``. Store numbers are read at scrape time from ``Store.stats()``, run on
the daemon's event loop (the store is not thread-safe), so a scrape never sees a torn snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.server.calls import CallRecord, current
from kvstore.server.interceptors import Behavior, HandlerInterceptor
from kvstore.server.metrics_http import start_metrics_http

_log = logging.getLogger("kvstore.server.metrics")
# From 100 us (a Lookup on a warm loop) to 30 s (a multi-GiB streamed Get).
LATENCY_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OTHER_LABEL = "other"  # the label of a tenant or model past a cap
DEFAULT_MAX_LABEL_VALUES = 32
SCRAPE_TIMEOUT_S = 2.0  # how long a scrape waits for the event loop before skipping store stats

# TierStats field -> (metric suffix, kind, help)
_TIER_FIELDS = {
    "capacity_bytes": ("capacity_bytes", "gauge", "configured capacity of the tier"),
    "used_bytes": ("used_bytes", "gauge", "bytes stored in the tier"),
    "num_blocks": ("blocks", "gauge", "blocks stored in the tier"),
    "hits": ("hits", "counter", "reads served by the tier"),
    "misses": ("misses", "counter", "reads the tier could not serve"),
    "evictions": ("evictions", "counter", "pages removed from the tier to make room"),
    "corrupt": ("corrupt_pages", "counter", "pages that failed verification and were dropped"),
    "rejected": ("rejected_writes", "counter", "writes the tier refused"),
    "bytes_read": ("read_bytes", "counter", "bytes read from the tier"),
    "bytes_written": ("written_bytes", "counter", "bytes written to the tier"),
}
# Counters field -> help; exported as kvstore_<name>_total
_COUNTER_HELP = {
    "lookups": "Lookup calls",
    "lookup_hit_tokens": "tokens found by lookups",
    "lookup_miss_tokens": "tokens lookups missed",
    "puts": "Put calls",
    "put_tokens": "tokens newly written by puts",
    "gets": "Get calls",
    "get_tokens": "tokens returned by gets",
    "demotions": "blocks moved to a slower tier",
    "promotions": "blocks moved to a faster tier",
    "dropped": "blocks that left the last tier holding them",
}
# StoreStats gauge field -> help
_GAUGE_HELP = {
    "active_leases": "leases pinning blocks now",
    "active_reservations": "reservations holding DRAM slots now",
    "num_blocks": "blocks stored in any tier",
}

# The cost model's estimates of each tier's read path (kept in the tier stats' extra gauges).
_PATH_GAUGES = {
    "read_bytes_per_s": ("read_bytes_per_second", "estimated read bandwidth, bytes/s"),
    "read_fixed_s": ("read_fixed_seconds", "estimated fixed cost per read, seconds"),
}

# The background write-through's queue per tier (kvstore.store.write_through), in the tier
# stats' extra: extra key -> (metric suffix, kind, help).
_WRITE_THROUGH = {
    "write_through_queued": ("write_through_queued", "counter",
                             "new blocks queued to be copied into the tier"),
    "write_through_written": ("write_through_written", "counter",
                              "queued blocks the tier took"),
    "write_through_skipped": ("write_through_skipped", "counter",
                              "new blocks the tier held already, or evicted before their turn"),
    "write_through_dropped_full": ("write_through_dropped_full", "counter",
                                   "new blocks dropped because the queue was full"),
    "write_through_failed": ("write_through_failed", "counter",
                             "queued blocks the tier refused or could not be reached for"),
    "write_through_dropped_closing": ("write_through_dropped_closing", "counter",
                                      "queued blocks left when the grace ran out at shutdown"),
    "write_through_queue_blocks": ("write_through_queue_blocks", "gauge",
                                   "blocks waiting in the queue or being written"),
    "write_through_queue_bytes": ("write_through_queue_bytes", "gauge",
                                  "bytes waiting in the queue or being written"),
}


def _family(kind: str, name: str, doc: str, labels: list[str] | None = None) -> Metric:
    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return cls(name, doc, labels=labels)


class StoreCollector(Collector):
    """Reads a stats snapshot at scrape time and yields it as metric families."""

    def __init__(self, snapshot: Callable[[], Any | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self._snapshot()
        if stats is None:
            return
        for field, (suffix, kind, doc) in _TIER_FIELDS.items():
            family = _family(kind, f"kvstore_tier_{suffix}", f"Per tier: {doc}.", ["tier"])
            for tier, tier_stats in stats.tiers.items():
                family.add_metric([tier], float(getattr(tier_stats, field)))
            yield family
        for key, (name, doc) in _PATH_GAUGES.items():
            family = GaugeMetricFamily(f"kvstore_tier_{name}", f"Per tier: {doc}.",
                                       labels=["tier"])
            for tier, tier_stats in stats.tiers.items():
                if key in tier_stats.extra:
                    family.add_metric([tier], float(tier_stats.extra[key]))
            yield family
        for key, (suffix, kind, doc) in _WRITE_THROUGH.items():
            family = _family(kind, f"kvstore_tier_{suffix}", f"Per tier: {doc}.", ["tier"])
            for tier, tier_stats in stats.tiers.items():
                if key in tier_stats.extra:
                    family.add_metric([tier], float(tier_stats.extra[key]))
            yield family
        for name, value in stats.counters.as_dict().items():
            doc = _COUNTER_HELP.get(name, name.replace("_", " "))
            family = CounterMetricFamily(f"kvstore_{name}", f"Store: {doc}.")
            family.add_metric([], float(value))
            yield family
        for name, doc in _GAUGE_HELP.items():
            yield GaugeMetricFamily(f"kvstore_{name}", f"Store: {doc}.",
                                    value=float(getattr(stats, name)))


def loop_snapshot(stats: Callable[[], Any], loop: asyncio.AbstractEventLoop
                  ) -> Callable[[], Any | None]:
    """A thread-safe snapshot: runs ``stats()`` on ``loop`` and waits for it (None on timeout)."""

    async def _read() -> Any:
        return stats()

    def snapshot() -> Any | None:
        if loop.is_closed() or not loop.is_running():
            return None
        future = asyncio.run_coroutine_threadsafe(_read(), loop)
        try:
            return future.result(timeout=SCRAPE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a failed scrape must not kill the HTTP thread
            future.cancel()
            _log.warning("store stats unavailable for a scrape: %r", exc)
            return None

    return snapshot


class LabelCap:
    """One label's values: the first ``limit`` distinct ones keep their own, later ones read
    ``OTHER_LABEL`` (a label's every value is a series Prometheus keeps forever; clients name
    tenants' models freely). The empty value (no tenant: local trust) never counts; a limit of
    0 leaves every value empty (no such label at all)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._kept: set[str] = set()

    def __call__(self, value: str) -> str:
        if not self._limit:
            return ""
        if not value or value in self._kept:
            return value
        if len(self._kept) < self._limit:
            self._kept.add(value)
            return value
        return OTHER_LABEL


class Metrics:
    """The daemon's metrics registry, its RPC instruments and its HTTP endpoint.

    Args:
        max_label_values: distinct tenants, and distinct models, that keep a label of their
            own (``server.metrics_max_label_values``).
    """

    def __init__(self, max_label_values: int = DEFAULT_MAX_LABEL_VALUES) -> None:
        self.registry = CollectorRegistry()
        # 0: the RPC metrics carry no tenant or model label at all, not even an empty one.
        self._by_tenant = max_label_values > 0
        named = ["tenant", "model"] if self._by_tenant else []
        self.rpc_latency = Histogram(
            "kvstore_rpc_latency_seconds", "RPC handling time, by method, tenant and model.",
            ["method", *named], registry=self.registry, buckets=LATENCY_BUCKETS_S,
        )
        self.rpc_errors = Counter(
            "kvstore_rpc_errors",
            "RPCs that ended in a non-OK status, by method, code, tenant and model.",
            ["method", "code", *named], registry=self.registry,
        )
        self._tenants, self._models = LabelCap(max_label_values), LabelCap(max_label_values)
        self._latency_by_labels: dict[tuple[str, ...], Any] = {}
        self._http: Any = None
        self._store_collector: StoreCollector | None = None

    def watch_store(self, snapshot: Callable[[], Any | None]) -> None:
        """Export the store's stats (one collector; a second call replaces the first)."""
        if self._store_collector is not None:
            self.registry.unregister(self._store_collector)
        self._store_collector = StoreCollector(snapshot)
        self.registry.register(self._store_collector)

    def observe(self, method: str, code: grpc.StatusCode, elapsed_s: float,
                record: CallRecord | None = None) -> None:
        """Count one call of ``method``, labelled by its ``record``'s tenant and model."""
        named: tuple[str, ...] = ()
        if self._by_tenant:
            named = (self._tenants(record.tenant) if record is not None else "",
                     self._models(record.model) if record is not None else "")
        labels = (method, *named)
        latency = self._latency_by_labels.get(labels)
        if latency is None:  # labels() takes a lock; resolve each child once
            latency = self._latency_by_labels[labels] = self.rpc_latency.labels(*labels)
        latency.observe(elapsed_s)
        if code != grpc.StatusCode.OK:
            self.rpc_errors.labels(method, code.name, *named).inc()

    def start_http(self, host: str, port: int, max_connections: int = 8,
                   timeout_s: float = 5.0) -> int:
        """Serve ``/metrics`` on ``host:port`` (0 picks a port), at most ``max_connections``
        at once, each request within ``timeout_s`` (``metrics_http.py``); the bound port."""
        server = start_metrics_http(host, port, self.registry, max_connections, timeout_s)
        self._http = server
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def final_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


class MetricsInterceptor(HandlerInterceptor):
    """Times every call and counts non-OK statuses; inside ``TracingInterceptor``, whose
    call record gives the labels."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self._metrics = metrics

    def wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            start, failure = time.perf_counter(), None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._metrics.observe(method, final_code(context, failure),
                                      time.perf_counter() - start, current())

        return run

    def wrap_streaming(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            start, failure = time.perf_counter(), None
            try:
                async for response in behavior(request, context):
                    yield response
            except BaseException as exc:
                failure = exc
                raise
            finally:
                self._metrics.observe(method, final_code(context, failure),
                                      time.perf_counter() - start, current())

        return run
