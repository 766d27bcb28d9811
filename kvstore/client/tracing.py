"""What a client's calls carry for the daemon's request spans: the engine's request id (set with
:func:`for_request`) and, where OpenTelemetry is installed and a span is current, its W3C trace
context, so the daemon's spans join the engine's trace.

Both are read from context variables when a call is made, so they follow a request through
threads' own contexts and asyncio tasks alike, and the blocking and the asyncio client carry
them the same way (gRPC metadata, or a call channel frame's metadata).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.rpc.metadata import MAX_REQUEST_ID_CHARS, REQUEST_ID_HEADER, TRACE_HEADERS

Metadata = tuple[tuple[str, str], ...]
_REQUEST_ID: ContextVar[str] = ContextVar("kvstore_request_id", default="")
_UNSET: Any = object()
_propagate: Any = _UNSET  # opentelemetry.propagate once looked up; None: not installed


@contextlib.contextmanager
def for_request(request_id: str) -> Iterator[None]:
    """Tag the calls this client makes in the body of the ``with`` (in this thread or task)
    with an engine's request id; the daemon's spans of them carry it.

    Args:
        request_id: the engine's id of the request, printable ASCII, at most
            ``MAX_REQUEST_ID_CHARS`` (128) characters.

    Raises:
        InvalidArgument: ``request_id`` is empty, too long or not printable ASCII.

    Example::

        with kvstore.client.for_request(request.request_id):
            result = client.lookup(ns, tokens)
    """
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS or not (
            request_id.isascii() and request_id.isprintable()):
        raise InvalidArgument(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII "
                              f"characters, got {request_id[:MAX_REQUEST_ID_CHARS + 1]!r}")
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def _otel_propagate() -> Any:
    """``opentelemetry.propagate``, or None where OpenTelemetry is not installed (looked up
    once: the import is the client's only cost of tracing)."""
    global _propagate
    if _propagate is _UNSET:
        try:
            from opentelemetry import propagate
        except ImportError:
            propagate = None
        _propagate = propagate
    return _propagate


def request_metadata() -> Metadata:
    """The metadata of a call made now: the request id and the current span's trace context
    (none where neither is set)."""
    pairs: list[tuple[str, str]] = []
    request_id = _REQUEST_ID.get()
    if request_id:
        pairs.append((REQUEST_ID_HEADER, request_id))
    propagate = _otel_propagate()
    if propagate is not None:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # nothing without a valid current span
        pairs.extend((key, carrier[key]) for key in TRACE_HEADERS if key in carrier)
    return tuple(pairs)
