"""Prometheus text on the metrics port: store gauges per tier, RPC latency and errors."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import AsyncClient
from kvstore.errors import LeaseNotFound
from kvstore.keys import Namespace
from kvstore.server.daemon import serve

from ..conftest import random_kv, random_tokens
from .helpers import small_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str, by_call: bool = False
            ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples by (name, labels); the RPC metrics summed over tenant and model unless
    ``by_call``."""
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items()
                      if by_call or k not in ("tenant", "model")}
            key = (s.name, tuple(sorted(labels.items())))
            got[key] = got.get(key, 0.0) + s.value
    return got


async def test_metrics_endpoint(root, ns, spec):
    d = await serve(small_config(root, metrics_port=free_port()))
    try:
        async with AsyncClient(d.unix_address, zero_copy=False) as client:
            tokens = random_tokens(48)
            await client.put(ns, tokens, random_kv(spec, 48))
            await client.lookup(ns, tokens)
            await client.get(ns, tokens)
            with pytest.raises(LeaseNotFound):
                await client.release("nope")
            reservation = await client.reserve(ns, random_tokens(16, seed=1))
            await client.abort(reservation.reservation_id)
            with pytest.raises(LeaseNotFound):
                await client.abort(reservation.reservation_id)
        url = f"http://127.0.0.1:{d.metrics_port}/metrics"
        # The scrape runs stats() on this loop, so it must not block the loop itself. A call's
        # latency is recorded as its handler ends, which may be just after the client saw the
        # reply: scrape until the last call shows up (a busy machine can lag by milliseconds).
        abort_count = ("kvstore_rpc_latency_seconds_count", (("method", "Abort"),))
        for _ in range(50):
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
            got = samples(text.decode())
            if got.get(abort_count) == 2:
                break
            await asyncio.sleep(0.1)
    finally:
        await d.stop(1.0)
    dram = (("tier", "dram"),)
    assert got[("kvstore_tier_blocks", dram)] == 3
    assert got[("kvstore_tier_used_bytes", dram)] >= 3 * spec.block_bytes
    assert got[("kvstore_tier_capacity_bytes", dram)] == 16 << 20
    assert ("kvstore_tier_hits_total", dram) in got
    assert got[("kvstore_tier_read_bytes_per_second", dram)] > 0  # the cost model's estimate
    assert ("kvstore_tier_misses_total", (("tier", "ssd"),)) in got
    assert got[("kvstore_lookups_total", ())] == 1
    assert got[("kvstore_lookup_hit_tokens_total", ())] == 48
    assert got[("kvstore_puts_total", ())] == 1
    assert ("kvstore_demotions_total", ()) in got and ("kvstore_active_leases", ()) in got
    for method in ("Put", "Lookup", "Get", "Release"):
        assert got[("kvstore_rpc_latency_seconds_count", (("method", method),))] == 1
    assert got[("kvstore_rpc_errors_total", (("code", "NOT_FOUND"), ("method", "Release")))] == 1
    assert got[("kvstore_rpc_latency_seconds_count", (("method", "Abort"),))] == 2
    assert got[("kvstore_rpc_errors_total", (("code", "NOT_FOUND"), ("method", "Abort")))] == 1
    assert ("kvstore_rpc_errors_total", (("code", "OK"), ("method", "Put"))) not in got


async def test_rpc_metrics_are_labelled_by_tenant_and_model_up_to_a_cap(root, spec):
    """Each of tenant and model keeps a label of its own for its first
    ``server.metrics_max_label_values`` values; later ones are counted as "other"."""
    d = await serve(small_config(root, metrics_max_label_values=2))
    try:
        async with AsyncClient(d.unix_address) as client:
            for i in range(4):
                ns = Namespace(model_id=f"model-{i}", spec=spec, tenant=f"tenant-{i}")
                await client.lookup(ns, random_tokens(32))
                await client.lookup(ns, random_tokens(32))
    finally:
        await d.stop(1.0)
    counts = {(s.labels["tenant"], s.labels["model"]): s.value
              for family in d.metrics.registry.collect() for s in family.samples
              if s.name == "kvstore_rpc_latency_seconds_count" and s.labels["method"] == "Lookup"}
    assert counts == {("tenant-0", "model-0"): 2, ("tenant-1", "model-1"): 2,
                      ("other", "other"): 4}
