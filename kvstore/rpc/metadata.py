"""Call metadata both ends agree on: the key that names a client's session (``Hold``; see
``kvstore.server.sessions``), the calls that carry it, and how session ids are made."""

from __future__ import annotations

import secrets

SESSION_HEADER = "kvstore-session"
SESSION_METHODS = frozenset({"Acquire", "Reserve"})  # what is granted under a session
OPEN_TIMEOUT_S = 2.0  # a client waits this long for the first heartbeat, then goes without
# Initial metadata of a SubscribeEvents stream, sent once the subscription is registered: a
# client returns from subscribe_events only then, so no event after that is missed, and a
# refusal (events off, another tenant, over the caps) raises there rather than at a read.
SUBSCRIBED_HEADER = "kvstore-subscribed"


def new_session_id() -> str:
    """128 random bits in hex: only the process that made it knows it."""
    return secrets.token_hex(16)

# The serving engine's id of the request a call is for (its spans and logs carry it). Printable
# ASCII; the daemon keeps at most MAX_REQUEST_ID_CHARS of it.
REQUEST_ID_HEADER = "x-kvstore-request-id"
MAX_REQUEST_ID_CHARS = 128
# W3C trace context (https://www.w3.org/TR/trace-context/), as OpenTelemetry's propagator sets it.
TRACE_HEADERS = ("traceparent", "tracestate")
