"""Request spans: every call's :class:`~kvstore.server.calls.CallRecord`, and with tracing on an
OpenTelemetry span of it exported over OTLP/gRPC (the ``tracing`` extra).

:class:`CallTracer` opens a call's record (an interceptor for gRPC, ``ChannelCalls`` for a call
channel: the same spans either way) and, for the methods in ``TRACED_METHODS`` with tracing
on, a span that continues the trace a client carried in the call's metadata (W3C
``traceparent``, through OpenTelemetry's configured propagator). The span ends with the
record's attributes (request id, tenant, model, tokens and bytes per tier), one event per
phase, and the call's status. Spans leave in a ``BatchSpanProcessor``'s thread: an exporter
that is slow or gone never holds up a call. The daemon imports OpenTelemetry only when
tracing is on, and runs without it installed.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import grpc

from kvstore.config import TracingConfig
from kvstore.errors import ConfigError
from kvstore.server.calls import CallRecord, recording, request_id_of
from kvstore.server.interceptors import Behavior, HandlerInterceptor
from kvstore.server.metrics import final_code

_log = logging.getLogger("kvstore.server.tracing")
# The calls an engine makes per request (and their writes' pieces); Hold, Stats, Health and
# the admin calls get no span.
TRACED_METHODS = frozenset({"Lookup", "Acquire", "Release", "Get", "Put", "OpenPut", "Hint",
                            "CancelHint", "Reserve", "Commit", "Abort"})
DEFAULT_SERVICE_NAME = "kvstore"
FLUSH_TIMEOUT_MS = 5000  # how long a stopping daemon waits for its last spans to leave


def _provider(config: TracingConfig) -> Any:
    """A private tracer provider exporting to ``config``'s endpoint (the process-wide one is
    the application's, where the daemon runs inside one)."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ConfigError(f"tracing.enabled needs OpenTelemetry, which is not installed "
                          f"({exc.name}): pip install 'kvstore[tracing]'") from None
    name = (config.service_name or os.environ.get("OTEL_SERVICE_NAME")
            or DEFAULT_SERVICE_NAME)
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}),
                              sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    # An empty endpoint leaves the exporter to OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, as
    # OpenTelemetry documents; "http://" means plaintext.
    exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint or None)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class CallTracer:
    """Opens each call's record and, with tracing on, its span.

    Args:
        config: the ``[tracing]`` section; enabled without OpenTelemetry installed is a
            ConfigError naming the extra to install.
    """

    def __init__(self, config: TracingConfig) -> None:
        self._provider = _provider(config) if config.enabled else None
        self._tracer = None if self._provider is None else self._provider.get_tracer("kvstore")

    @property
    def is_enabled(self) -> bool:
        return self._tracer is not None

    def call(self, method: str, metadata: Any) -> _CallScope:
        """``with tracer.call(method, metadata) as record:`` the record of one call for the
        body of the ``with``, and its span where traced; the caller sets
        ``record.attributes["rpc.grpc.status_code"]`` before it ends (else OK, or ERROR for an
        exception)."""
        record = CallRecord(method, request_id=request_id_of(metadata))
        traced = self._tracer is not None and method in TRACED_METHODS
        return _CallScope(self if traced else None, record, metadata)

    def export(self, record: CallRecord, metadata: Any, start_ns: int,
                failure: BaseException | None) -> None:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        span = self._tracer.start_span(f"kvstore/{record.method}", propagate.extract(carrier),
                                       kind=SpanKind.SERVER, start_time=start_ns)
        attributes: dict[str, Any] = {"rpc.system": "grpc", "rpc.service": "kvstore.v1.KVStore",
                                      "rpc.method": record.method}
        if record.request_id:
            attributes["kvstore.request_id"] = record.request_id
        if record.tenant:
            attributes["kvstore.tenant"] = record.tenant
        if record.model:
            attributes["kvstore.model"] = record.model
        attributes.update(record.attributes)
        for name, wall_ns, seconds in record.phases:
            span.add_event(name, {"duration_s": seconds}, timestamp=wall_ns)
            key = f"kvstore.phase.{name}_s"
            attributes[key] = attributes.get(key, 0.0) + seconds
        span.set_attributes(attributes)
        code = record.attributes.get("rpc.grpc.status_code", 0)
        if failure is not None or code:
            span.set_status(Status(StatusCode.ERROR, None if failure is None
                                   else type(failure).__name__))
        span.end()

    def shutdown(self) -> None:
        """Send the spans still queued (waits up to ``FLUSH_TIMEOUT_MS``) and stop exporting;
        blocking: run it in a thread."""
        if self._provider is not None:
            self._provider.force_flush(FLUSH_TIMEOUT_MS)
            self._provider.shutdown()
            self._provider = self._tracer = None


class _CallScope(recording):
    """A call's record made current and, with a tracer, its span exported at the end. A
    class, not a generator: it runs on every call."""

    __slots__ = ("_metadata", "_start_ns", "_tracer")

    def __init__(self, tracer: CallTracer | None, record: CallRecord, metadata: Any) -> None:
        super().__init__(record)
        self._tracer, self._metadata = tracer, metadata
        self._start_ns = time.time_ns() if tracer is not None else 0

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        super().__exit__()
        if self._tracer is not None:
            try:
                self._tracer.export(self._record, self._metadata, self._start_ns, exc)
            except Exception:  # noqa: BLE001 - a span that cannot be made never fails a call
                _log.exception("could not record the span of a %s call", self._record.method)


class TracingInterceptor(HandlerInterceptor):
    """Opens every gRPC call's record and span (``CallTracer.call``); the outermost
    interceptor, so the metrics interceptor inside it reads the record's labels."""

    def __init__(self, tracer: CallTracer) -> None:
        super().__init__()
        self._tracer = tracer

    def wrap_unary(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            with self._tracer.call(method, context.invocation_metadata()) as record:
                failure = None
                try:
                    return await behavior(request, context)
                except BaseException as exc:
                    failure = exc
                    raise
                finally:
                    _note_status(record, context, failure)

        return run

    def wrap_streaming(self, method: str, behavior: Behavior) -> Behavior:
        async def run(request, context):
            with self._tracer.call(method, context.invocation_metadata()) as record:
                failure = None
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    failure = exc
                    raise
                finally:
                    _note_status(record, context, failure)

        return run


def _note_status(record: CallRecord, context: grpc.aio.ServicerContext,
                 failure: BaseException | None) -> None:
    code = final_code(context, failure)
    record.attributes["rpc.grpc.status_code"] = code.value[0]
