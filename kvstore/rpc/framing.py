"""The data socket's wire format: a connection's hello and ticket, a Put's or Get's raw bytes,
and the call channel's frames; with the client's blocking ends of a transfer.

The data socket moves the tensor bytes of a Put or Get beside gRPC, outside its message
framing, under a one-time ticket that a gRPC call handed out.

The daemon listens on a Unix socket beside its gRPC one (``data_socket_path``:
``<socket_path>.data``, with the gRPC socket's mode) and, when it serves TCP, on a data port of
the same host (``server.data_port``). One transfer per connection:

- the client sends a hello: ``HELLO`` (magic ``KVD1``, the 32-byte ticket, the byte length of
  its bearer token as little-endian uint16), then the token (nothing under local trust);
- Put (ticket from OpenPut): exactly the ticket's ``total_bytes`` follow the hello, then the
  client shuts its side down; the daemon reads them straight into the buffer it set aside (no
  zero-fill), and the Put call that carries the ticket stores them and reports the outcome;
- Get (ticket in a GetHeader): the daemon answers with exactly ``total_bytes`` and closes;
  the client reads them into a tensor it allocated (``torch.empty``), and the Get stream
  ends with the transfer's status.

A ticket is 32 bytes from ``secrets``, good for one connection, for the caller (tenant and
transport) it went to, until its deadline. A wrong hello is answered by closing the
connection; the gRPC call that owns the ticket says what went wrong. Each side copies a byte
once, kernel to buffer or buffer to kernel. Both ends import this module, which imports
neither end.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.socket_paths import check_socket_path

DATA_SOCKET_SUFFIX = ".data"
MAGIC = b"KVD1"
TICKET_BYTES = 32  # 256 random bits: unguessable, so holding one is what proves the call
MAX_TOKEN_BYTES = 4096
HELLO = struct.Struct("<4s32sH")  # magic, ticket, token length
# Bytes a Unix data connection may hold in flight each way. With Linux's default (208 KiB) a
# 32 MiB get took 19-54 ms on the 2-core box, each 208 KiB a wakeup of the reader; with 4 MiB
# 11-14 ms (2026-12-01).
UNIX_BUFFER_BYTES = 4 << 20


def data_socket_path(socket_path: str) -> str:
    """Where the daemon serving ``socket_path`` takes data connections."""
    return socket_path + DATA_SOCKET_SUFFIX


def new_ticket() -> bytes:
    return secrets.token_bytes(TICKET_BYTES)


def encode_hello(ticket: bytes, token: str | None) -> bytes:
    """The bytes a client opens a data connection with."""
    raw = (token or "").encode()
    if len(ticket) != TICKET_BYTES:
        raise InvalidArgument(f"a data ticket has {TICKET_BYTES} bytes, got {len(ticket)}")
    if len(raw) > MAX_TOKEN_BYTES:
        raise InvalidArgument(f"bearer token of {len(raw)} bytes exceeds {MAX_TOKEN_BYTES}")
    return HELLO.pack(MAGIC, ticket, len(raw)) + raw


def parse_hello(fixed: bytes) -> tuple[bytes, int]:
    """``(ticket, token length)`` of a hello's fixed part; InvalidArgument if malformed."""
    magic, ticket, token_bytes = HELLO.unpack(fixed)
    if magic != MAGIC:
        raise InvalidArgument(f"data connection does not start with {MAGIC!r}")
    if token_bytes > MAX_TOKEN_BYTES:
        raise InvalidArgument(f"data connection declares a {token_bytes}-byte token; at most "
                              f"{MAX_TOKEN_BYTES}")
    return ticket, token_bytes


# ------------------------------------------------------------------------------ client side


@dataclass(frozen=True, slots=True)
class DataAddress:
    """Where a client connects for one transfer."""

    family: int  # socket.AF_UNIX or AF_INET / AF_INET6
    address: str | tuple[str, int]


def connect(address: DataAddress, timeout_s: float) -> socket.socket:
    """A blocking connection whose every send and receive waits at most ``timeout_s``; a Unix
    socket's path is checked first (``check_socket_path``: ConfigError, Unavailable)."""
    if address.family == socket.AF_UNIX:
        check_socket_path(address.address)
    sock = socket.socket(address.family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(address.address)
        if address.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


def widen_buffers(sock: socket.socket) -> None:
    """Let a Unix data connection hold ``UNIX_BUFFER_BYTES`` in flight (as far as the host's
    ``net.core.wmem_max`` allows): a transfer then moves in a few handoffs, not hundreds of
    208 KiB ones, each a wakeup of the other side. TCP sizes its own buffers; left alone."""
    if sock.family == socket.AF_UNIX:
        with contextlib.suppress(OSError):  # a host that refuses keeps its default
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UNIX_BUFFER_BYTES)


def send_put(sock: socket.socket, ticket: bytes, token: str | None, data: memoryview) -> None:
    """Send a Put's hello and bytes on a connected ``sock`` and end the stream; closes it."""
    with sock:
        widen_buffers(sock)
        sock.sendall(encode_hello(ticket, token))
        sock.sendall(data)  # straight from the tensor's memory, no message around it
        sock.shutdown(socket.SHUT_WR)


def receive_get(sock: socket.socket, ticket: bytes, token: str | None, out: memoryview) -> None:
    """Send a Get's hello on a connected ``sock`` and read the bytes into ``out``; closes it.

    Raises:
        ConnectionError: the daemon closed the connection before ``out`` was full.
    """
    with sock:
        widen_buffers(sock)
        sock.sendall(encode_hello(ticket, token))
        pos, total = 0, len(out)
        while pos < total:
            got = sock.recv_into(out[pos:])
            if not got:
                raise ConnectionError(f"the data socket closed after {pos} of {total} bytes")
            pos += got


# ------------------------------------------------------------------------------ call channels
#
# A call channel is a data connection whose hello presented a ticket from OpenChannel: it stays
# open and carries small unary calls outside gRPC, each the same request and response message
# its gRPC method takes, serialised, in a frame: ``FRAME`` (the body's length, a method byte
# (request) or status code (reply), the request id, little-endian) then the body. A reply has
# its request's id; one of status 0 carries the response message, any other the gRPC status
# code the gRPC path would end with and a ``CallError`` (details, the kvstore exception class,
# a rate limit's wait), so the client raises the same exception. The daemon answers the hello
# with a reply of id ``OPENED_ID``: status 0 and no body once the channel is open, else the
# error that refused it. Replies may come in any order; the client matches them by id.

CHANNEL_METHODS = ("Lookup", "Acquire", "Release", "Reserve", "Commit", "Abort")
FRAME = struct.Struct("<IBI")  # body bytes, method byte or status code, request id
OPENED_ID = 0  # the id of the daemon's answer to a channel's hello; calls count from 1
MAX_REQUEST_ID = (1 << 32) - 1
# Frames a channel may have in flight: the daemon reads no further frame of a channel that has
# this many unanswered (a client with more waits on its socket, not the daemon's memory).
MAX_FRAMES_IN_FLIGHT = 64
_FRAME_SLACK_BYTES = 64 << 10  # a request's fields beside its tokens (namespace, ids)


# A request frame whose method byte has this bit set starts its body with call metadata (the
# engine's request id, W3C trace context: ``kvstore.rpc.metadata``): ``CALL_METADATA`` (its
# byte length), then ``key=value`` lines in ASCII, then the request message. Clients set it
# only when they have metadata to send.
METADATA_FLAG = 0x80
CALL_METADATA = struct.Struct("<H")
MAX_METADATA_BYTES = 4096


def encode_metadata(pairs: tuple[tuple[str, str], ...]) -> bytes:
    """A frame's metadata prefix for ``pairs`` (the frame's method byte gets ``METADATA_FLAG``);
    InvalidArgument for a key or value a line cannot carry, or too many bytes."""
    lines = []
    for key, value in pairs:
        if "=" in key or not (key + value).isascii() or not (key + value).isprintable():
            raise InvalidArgument(f"call metadata {key!r} must be printable ASCII (no '=' in "
                                  "the key)")
        lines.append(f"{key}={value}")
    raw = "\n".join(lines).encode("ascii")
    if len(raw) > MAX_METADATA_BYTES:
        raise InvalidArgument(f"call metadata of {len(raw)} bytes exceeds {MAX_METADATA_BYTES}")
    return CALL_METADATA.pack(len(raw)) + raw


def split_metadata(body: bytes | bytearray
                   ) -> tuple[tuple[tuple[str, str], ...], memoryview]:
    """``(metadata pairs, request body)`` of a frame body that starts with metadata (the
    request body a view of it, not a copy); InvalidArgument where the prefix is malformed."""
    if len(body) < CALL_METADATA.size:
        raise InvalidArgument("a call frame flagged with metadata is shorter than its prefix")
    (length,) = CALL_METADATA.unpack_from(body)
    end = CALL_METADATA.size + length
    if length > MAX_METADATA_BYTES or end > len(body):
        raise InvalidArgument(f"a call frame declares {length} bytes of metadata; at most "
                              f"{min(MAX_METADATA_BYTES, len(body) - CALL_METADATA.size)}")
    try:
        text = bytes(body[CALL_METADATA.size:end]).decode("ascii")
    except UnicodeDecodeError:
        raise InvalidArgument("call frame metadata is not ASCII") from None
    pairs = tuple(tuple(line.split("=", 1)) for line in text.split("\n") if line)
    if any(len(pair) != 2 for pair in pairs):
        raise InvalidArgument("call frame metadata holds a line that is not key=value")
    return pairs, memoryview(body)[end:]


def method_byte(method: str) -> int:
    """The byte that names ``method`` in a request frame (1 for the first of
    ``CHANNEL_METHODS``); InvalidArgument for a method the channel does not carry."""
    try:
        return CHANNEL_METHODS.index(method) + 1
    except ValueError:
        raise InvalidArgument(f"a call channel does not carry {method!r}; it carries "
                              f"{', '.join(CHANNEL_METHODS)}") from None


def method_of(byte: int) -> str | None:
    """The method a request frame's byte names (``METADATA_FLAG`` aside); None for a byte that
    names none."""
    byte &= ~METADATA_FLAG
    return CHANNEL_METHODS[byte - 1] if 1 <= byte <= len(CHANNEL_METHODS) else None


def encode_call(method: str, request_id: int, body: bytes,
                metadata: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A request frame: ``method``'s byte (flagged, with ``metadata`` before ``body``, where
    there is metadata)."""
    if not metadata:
        return encode_frame(method_byte(method), request_id, body)
    return encode_frame(method_byte(method) | METADATA_FLAG, request_id,
                        encode_metadata(metadata) + body)


def max_frame_bytes(max_request_tokens: int, max_message_bytes: int) -> int:
    """The largest request body a daemon takes on a channel: a request of the most tokens one
    call may name (4 bytes each), its other fields, and never more than a gRPC message."""
    return min(4 * max_request_tokens + _FRAME_SLACK_BYTES, max_message_bytes)


def encode_frame(kind: int, request_id: int, body: bytes) -> bytes:
    """One frame: ``FRAME`` then ``body`` (``kind``: a method byte or a status code)."""
    return FRAME.pack(len(body), kind, request_id) + body
