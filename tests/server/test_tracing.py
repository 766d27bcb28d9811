"""Request spans reach a real OTLP/gRPC receiver: the engine's request id, tenant, model and
tokens per tier on each, the client's trace continued, over gRPC and call channels alike; and
the daemon and client run without OpenTelemetry installed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.sdk.trace import TracerProvider

from kvstore.client import AsyncClient, Client, for_request
from kvstore.config import TracingConfig
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.server.daemon import DaemonThread, serve

from ..conftest import REPO_ROOT, random_kv, random_tokens
from .helpers import small_config


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on a free port: the spans exported to it, by name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = {kv.key: kv.value.string_value
                           for kv in resource_spans.resource.attributes}.get("service.name")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "service": service,
                            "trace_id": span.trace_id.hex(), "parent": span.parent_span_id.hex(),
                            "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
                            "events": [event.name for event in span.events],
                            "error": span.status.code == span.status.STATUS_CODE_ERROR})
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[dict]:
        with self._lock:
            return [span for span in self.spans if span["name"] == f"kvstore/{name}"]


def _value(value):
    return getattr(value, value.WhichOneof("value"))


@pytest.fixture
def receiver():
    receiver = Receiver()
    receiver.server.start()
    yield receiver
    receiver.server.stop(0)


def traced(config, receiver: Receiver, **fields):
    return dataclasses.replace(config, tracing=TracingConfig(
        enabled=True, otlp_endpoint=f"http://127.0.0.1:{receiver.port}", **fields))


@pytest.mark.parametrize("call_channel", [True, False])
async def test_spans_carry_the_request_and_continue_the_clients_trace(root, receiver, ns, spec,
                                                                      call_channel):
    engine = TracerProvider().get_tracer("engine")
    tokens, kv = random_tokens(64), random_kv(spec, 64)
    daemon = await serve(traced(small_config(root), receiver, service_name="kvs-test"))
    try:
        async with AsyncClient(daemon.unix_address, call_channel=call_channel) as client:
            with engine.start_as_current_span("request") as parent, for_request("req-7"):
                assert await client.put(ns, tokens[:48], kv[:, :, :48], zero_copy=False) == 48
                assert (await client.lookup(ns, tokens)).matched_tokens == 48
                lease = await client.acquire(ns, tokens)
                await client.release(lease.lease_id)
                await client.get(ns, tokens, zero_copy=False)
                await client.hint(ns, tokens, deadline_s=5.0)
            await client.lookup(ns, tokens)  # no request, no current span
        # Lookup, Acquire, Release and the last Lookup went the way the test meant
        assert (daemon.datapath.calls.num_calls >= 4) == call_channel
    finally:
        await daemon.stop(1.0)  # sends the spans still queued
    trace_id = format(parent.get_span_context().trace_id, "032x")
    parent_id = format(parent.get_span_context().span_id, "016x")
    for name in ("Put", "Lookup", "Acquire", "Release", "Get", "Hint"):
        span = receiver.named(name)[0]
        assert span["service"] == "kvs-test"
        assert (span["trace_id"], span["parent"]) == (trace_id, parent_id), name
        assert span["attributes"]["kvstore.request_id"] == "req-7", name
        assert not span["error"], name
        if name == "Release":  # names no namespace; the caller has no tenant (local trust)
            continue
        assert span["attributes"]["kvstore.tenant"] == "acme", name
        assert span["attributes"]["kvstore.model"] == "test/model", name
        assert "store" in span["events"], name
    lookup, later = receiver.named("Lookup")
    assert lookup["attributes"]["kvstore.tokens.dram"] == 48
    assert lookup["attributes"]["kvstore.matched_tokens"] == 48
    assert lookup["attributes"]["kvstore.phase.store_s"] >= 0
    acquire = receiver.named("Acquire")[0]["attributes"]
    assert acquire["kvstore.tokens.dram"] == 48 and acquire["kvstore.blocks"] == 3
    assert acquire["kvstore.bytes"] >= 3 * spec.block_bytes
    get = receiver.named("Get")[0]["attributes"]
    assert get["kvstore.matched_tokens"] == 48 and get["kvstore.bytes"] == kv[:, :, :48].nbytes
    assert receiver.named("Put")[0]["attributes"]["kvstore.tokens_written"] == 48
    # without a span of the client's, the daemon starts a trace of its own
    assert later["trace_id"] != trace_id and later["parent"] == ""
    assert "kvstore.request_id" not in later["attributes"]


async def test_a_failed_call_is_an_error_span(root, receiver, ns):
    daemon = await serve(traced(small_config(root), receiver))
    try:
        async with AsyncClient(daemon.unix_address) as client:
            with for_request("req-bad"), pytest.raises(InvalidArgument):
                await client.hint(ns, random_tokens(32), deadline_s=-1.0)
    finally:
        await daemon.stop(1.0)
    (span,) = receiver.named("Hint")
    assert span["error"] and span["attributes"]["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT
    assert span["attributes"]["kvstore.request_id"] == "req-bad"


def test_the_blocking_client_carries_the_same(root, receiver, ns, spec):
    engine = TracerProvider().get_tracer("engine")
    tokens = random_tokens(32, seed=1)
    with DaemonThread(traced(small_config(root), receiver)) as daemon, \
            Client(daemon.unix_address) as client:
        client.put(ns, tokens, random_kv(spec, 32, seed=1))
        with engine.start_as_current_span("request") as parent, for_request("req-9"):
            client.lookup(ns, tokens)
    (span,) = receiver.named("Lookup")
    assert span["trace_id"] == format(parent.get_span_context().trace_id, "032x")
    assert span["attributes"]["kvstore.request_id"] == "req-9"
    assert span["attributes"]["kvstore.tokens.dram"] == 32


def test_sample_ratio_zero_drops_the_daemons_own_traces_but_follows_a_sampled_parent(
        root, receiver, ns):
    engine = TracerProvider().get_tracer("engine")
    with DaemonThread(traced(small_config(root), receiver, sample_ratio=0.0)) as daemon, \
            Client(daemon.unix_address) as client:
        client.lookup(ns, random_tokens(32))
        with engine.start_as_current_span("request"):
            client.lookup(ns, random_tokens(32))
    assert len(receiver.named("Lookup")) == 1


def test_a_bad_request_id_is_refused_by_name():
    for bad in ("", "x" * 129, "line\nbreak", "naïve"):
        with pytest.raises(InvalidArgument, match="request_id"), for_request(bad):
            pass


def test_tracing_without_opentelemetry_is_a_config_error_naming_the_extra(root, monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    config = dataclasses.replace(small_config(root), tracing=TracingConfig(enabled=True))
    with pytest.raises(ConfigError, match=r"kvstore\[tracing\]"), DaemonThread(config):
        pass


def test_daemon_and_client_run_without_opentelemetry(root, ns):
    """Neither imports OpenTelemetry unless tracing is on: both serve with it absent."""
    script = f"""
import sys
sys.modules["opentelemetry"] = None  # as if not installed: any import of it fails
from kvstore.client import Client, for_request
from kvstore.keys import Namespace
from kvstore.spec import KVSpec
from kvstore.server.daemon import DaemonThread
from tests.server.helpers import small_config
from pathlib import Path
ns = Namespace(model_id="m", spec=KVSpec(2, 2, 16, 16, "bfloat16"), tenant="acme")
with DaemonThread(small_config(Path({str(root)!r}))) as daemon:
    with Client(daemon.unix_address) as client, for_request("r1"):
        print("matched", client.lookup(ns, list(range(32))).matched_tokens)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "matched 0" in out.stdout
