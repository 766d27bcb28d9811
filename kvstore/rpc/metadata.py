"""Call metadata both ends agree on: the key that names a client's session (``Hold``; see
``kvstore.server.sessions``), the calls that carry it, and how session ids are made."""

from __future__ import annotations

import secrets

SESSION_HEADER = "kvstore-session"
SESSION_METHODS = frozenset({"Acquire", "Reserve"})  # what is granted under a session
OPEN_TIMEOUT_S = 2.0  # a client waits this long for the first heartbeat, then goes without


def new_session_id() -> str:
    """128 random bits in hex: only the process that made it knows it."""
    return secrets.token_hex(16)
