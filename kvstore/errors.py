"""The one exception tree of kvstore; every edge (gRPC, client, CLI) translates from it."""

from __future__ import annotations


class KVStoreError(Exception):
    """Root of every error kvstore raises on purpose."""


class InvalidArgument(KVStoreError, ValueError):
    """The caller passed something malformed: wrong shape, dtype, tokens, key or option."""


class ConfigError(InvalidArgument):
    """A configuration field is out of range or unparsable; the message names the field."""


class NoSlotTier(InvalidArgument):
    """The store has no tier lending slots of the memory asked for (a device lease from a
    daemon without a GPU tier): use the other medium, or put and get."""


class NotFound(KVStoreError, KeyError):
    """A named object (block, lease, tenant) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class LeaseNotFound(NotFound):
    """A lease id that was never issued, already released or already expired."""


class CapacityError(KVStoreError):
    """A tier or request is over its configured bound (RESOURCE_EXHAUSTED at the edge)."""


class RateLimited(CapacityError):
    """The caller made more calls than ``server.rate_limit_rps`` allows; ``retry_after_s`` (and
    the message) say when to retry."""

    def __init__(self, message: str = "", retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class CorruptPage(KVStoreError):
    """A stored page failed its magic, version, key or checksum check; it is never served."""


class CodecError(KVStoreError, ValueError):
    """A codec cannot encode this input, or a blob is truncated, damaged or foreign."""


class PermissionDenied(KVStoreError):
    """The caller's tenant may not touch this namespace or block."""


class Unauthenticated(KVStoreError):
    """No bearer token, or one that matches no tenant."""


class Unavailable(KVStoreError):
    """The daemon cannot be reached or is shutting down; safe to retry."""


class FailedPrecondition(KVStoreError):
    """The call cannot work in the caller's situation (e.g. zero-copy over TCP); the message
    says what to do instead."""


class DeadlineExceeded(KVStoreError):
    """A streamed request stopped making progress for ``server.stream_idle_timeout_s``."""


class AlreadyRunning(FailedPrecondition):
    """Another daemon already serves this socket."""


SHOWN_CHARS = 64  # the most of a caller's string an error message repeats


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr`` of a caller-supplied value for an error message, cut to ``limit`` characters.

    Messages travel back to the caller and into the log: repeating a megabyte-long tenant or
    dtype name would bloat both, so longer values keep their head and their length.
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"
