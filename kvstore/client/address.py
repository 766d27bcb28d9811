"""How a client reaches the daemon: its address, channel options, call metadata and deadline,
resolved from the client's arguments once (:class:`ClientSettings`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.client.retry import RetryPolicy
from kvstore.client.tracing import request_metadata
from kvstore.config import ServerConfig
from kvstore.errors import InvalidArgument
from kvstore.rpc.tensors import chunk_limit

DEFAULT_TIMEOUT_S = 60.0  # deadline of each call unless the client is given another


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed client address."""

    grpc_target: str
    is_unix: bool

    @property
    def unix_path(self) -> str | None:
        """The socket file of a ``unix:`` target (``unix:///abs`` or ``unix:path``), else None."""
        if not self.is_unix:
            return None
        prefix = "unix://" if self.grpc_target.startswith("unix://") else "unix:"
        return self.grpc_target[len(prefix):]


def default_address() -> str:
    return f"unix://{ServerConfig().socket_path}"


def parse_address(address: str | None) -> Target:
    """``unix:///path`` (or a bare absolute path) or ``host:port``."""
    address = address or default_address()
    if address.startswith("unix:"):
        return Target(address, True)
    if address.startswith("/"):
        return Target(f"unix://{address}", True)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"address {address!r}: expected unix:///path or host:port")
    return Target(address, False)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # Reconnect quickly: the daemon is local, and gRPC's default first reconnect waits 1 s,
    # longer than a daemon restart, during which every call fails fast as UNAVAILABLE.
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000)]


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """A client's arguments, resolved: where the daemon is and what every call carries."""

    target: Target
    channel_options: tuple[tuple[str, int], ...]
    auth_metadata: tuple[tuple[str, str], ...]  # sent with every call (the bearer token)
    retry: RetryPolicy
    timeout_s: float  # deadline of each call
    chunk_bytes: int  # tensor bytes per streamed Put message

    @classmethod
    def resolve(cls, address: str | None, token: str | None, retry: RetryPolicy | None,
                timeout_s: float, max_message_bytes: int) -> ClientSettings:
        """Settings from a client's constructor arguments (see :class:`kvstore.client.Client`)."""
        return cls(target=parse_address(address),
                   channel_options=tuple(channel_options(max_message_bytes)),
                   auth_metadata=call_metadata(token), retry=retry or RetryPolicy(),
                   timeout_s=timeout_s, chunk_bytes=chunk_limit(max_message_bytes))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a call made now carries: the bearer token, and the request id and trace
        context of the caller's context (``kvstore.client.tracing``)."""
        return self.auth_metadata + request_metadata()
