"""The record of one call in progress: who it is for and what it did, for spans and metrics.

The outermost edge of a call (``tracing.TracingInterceptor`` for gRPC, ``ChannelCalls`` for a
call channel) opens a :class:`CallRecord` in a context variable; the handlers note what they
learn (:func:`note_namespace`, :func:`note`, :func:`phase`) without knowing whether anyone
reads it; at the call's end its span takes the record's attributes and the metrics its tenant
and model labels. Noting is a few dict writes: cheap enough to do with tracing off.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvstore.keys import Namespace
from kvstore.rpc.metadata import MAX_REQUEST_ID_CHARS, REQUEST_ID_HEADER

Attribute = str | int | float | bool


@dataclass(slots=True)
class CallRecord:
    """One call's request id, tenant and model, attributes and phases (name -> start, seconds).

    Attribute names are OpenTelemetry's dotted form (``kvstore.tokens.dram``); each phase
    becomes a span event at its start and a ``kvstore.phase.<name>_s`` attribute.
    """

    method: str
    request_id: str = ""
    tenant: str = ""
    model: str = ""
    attributes: dict[str, Attribute] = field(default_factory=dict)
    phases: list[tuple[str, int, float]] = field(default_factory=list)  # name, start ns, seconds


_CURRENT: ContextVar[CallRecord | None] = ContextVar("kvstore_call", default=None)


def request_id_of(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The engine's request id a call's metadata carries ("" if none), cut to
    ``MAX_REQUEST_ID_CHARS``: it only labels spans, so an overlong one is shortened, not
    refused."""
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str):
            return value[:MAX_REQUEST_ID_CHARS]
    return ""


class recording:  # lower case: used like a function, ``with recording(record):``
    """Make ``record`` the current call's for the body of the ``with``. A class, not a
    generator: it runs on every call (a generator-based one cost microseconds more)."""

    __slots__ = ("_record", "_token")

    def __init__(self, record: CallRecord) -> None:
        self._record = record

    def __enter__(self) -> CallRecord:
        self._token = _CURRENT.set(self._record)
        return self._record

    def __exit__(self, *exc_info: object) -> None:
        try:
            _CURRENT.reset(self._token)
        except ValueError:  # a streamed reply's generator closed from another context
            _CURRENT.set(None)


def current() -> CallRecord | None:
    """The record of the call this code runs for; None outside a call (the store's own tasks,
    direct use of a handler core)."""
    return _CURRENT.get()


def note_tenant(tenant: str | None) -> None:
    """The tenant a call is for, where it names no namespace (a caller's own tenant)."""
    record = _CURRENT.get()
    if record is not None and tenant and not record.tenant:
        record.tenant = tenant


def note_namespace(ns: Namespace) -> None:
    """The tenant and model a call's namespace names (the tenant was checked against the
    caller's before this)."""
    record = _CURRENT.get()
    if record is not None:
        record.tenant, record.model = ns.tenant, ns.model_id


def note(**attributes: Attribute) -> None:
    """Add ``kvstore.<name>`` attributes to the current call's record (none outside a call)."""
    record = _CURRENT.get()
    if record is not None:
        for name, value in attributes.items():
            record.attributes[f"kvstore.{name}"] = value


def note_tiers(prefix: str, by_tier: dict[str, int]) -> None:
    """``kvstore.<prefix>.<tier>`` for each tier of ``by_tier`` (tokens or bytes per tier)."""
    record = _CURRENT.get()
    if record is not None:
        for tier, value in by_tier.items():
            record.attributes[f"kvstore.{prefix}.{tier}"] = value


class phase:  # lower case: used like a function, ``with phase("store"):``
    """Time the body of the ``with`` as the current call's phase ``name`` (a phase run twice
    is two events); nothing outside a call."""

    __slots__ = ("_name", "_record", "_start", "_wall_ns")

    def __init__(self, name: str) -> None:
        self._name = name
        self._record = _CURRENT.get()

    def __enter__(self) -> None:
        if self._record is not None:
            self._wall_ns, self._start = time.time_ns(), time.perf_counter()

    def __exit__(self, *exc_info: object) -> None:
        if self._record is not None:
            self._record.phases.append((self._name, self._wall_ns,
                                        time.perf_counter() - self._start))
