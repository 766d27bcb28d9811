"""The client's ends of the daemon's sockets beside gRPC: call channels (``BlockingChannel``,
``AsyncChannel``: small calls framed by ``kvstore.rpc.framing``, their failures read like gRPC's)
and the data socket (``DataSocket``: Put/Get tensor bytes under one-time tickets)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import grpc
from google.protobuf.message import Message

from kvstore.client.address import Target
from kvstore.client.tracing import request_metadata
from kvstore.errors import CapacityError, DeadlineExceeded, LeaseNotFound, Unavailable
from kvstore.rpc import framing
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.framing import (
    CHANNEL_METHODS,
    FRAME,
    MAX_REQUEST_ID,
    OPENED_ID,
    DataAddress,
    connect,
)
from kvstore.rpc.status import ERROR_METADATA_KEY, RETRY_AFTER_METADATA_KEY, translate
from kvstore.socket_paths import check_socket_path

_log = logging.getLogger("kvstore.client.channels")

# ------------------------------------------------------------------------------ call channels

_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
_METHODS = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name
REPLY_TYPES: dict[str, type[Message]] = {
    name: getattr(pb, _METHODS[name].output_type.name) for name in CHANNEL_METHODS}


class ChannelStatus(grpc.RpcError):
    """A call that failed on a call channel, read like its gRPC twin's failure (code, details,
    trailers), so the clients' retry and translation treat both alike."""

    def __init__(self, code: grpc.StatusCode, details: str, error: str = "",
                 retry_after_s: float = 0.0) -> None:
        super().__init__(details)
        self._code, self._details = code, details
        self._trailers: tuple[tuple[str, str], ...] = ()
        if error:
            self._trailers += ((ERROR_METADATA_KEY, error),)
        if retry_after_s:
            self._trailers += ((RETRY_AFTER_METADATA_KEY, f"{retry_after_s:.3f}"),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


class ChannelBroken(ConnectionError):
    """A call channel closed or failed under a call: the client makes it over gRPC."""


def read_reply(status: int, body: bytes, reply_type: type[Message] | None) -> Message | None:
    """A reply frame's response message (None without ``reply_type``: the hello's answer);
    ChannelStatus for a failed call."""
    if status:
        error = pb.CallError.FromString(body)
        raise ChannelStatus(_STATUS_BY_VALUE.get(status, grpc.StatusCode.UNKNOWN),
                            error.details, error.error, error.retry_after_s)
    return reply_type.FromString(body) if reply_type is not None else None


def reply_header(header: bytes, max_reply_bytes: int) -> tuple[int, int, int]:
    """``(body bytes, status, request id)`` of a reply frame's header; ChannelBroken for a
    body larger than the client takes."""
    length, status, request_id = FRAME.unpack(header)
    if length > max_reply_bytes:
        raise ChannelBroken(f"the daemon sent a {length}-byte reply on the call channel; "
                            f"this client takes at most {max_reply_bytes}")
    return length, status, request_id


class BlockingChannel:
    """A call channel (``kvstore.rpc.framing``) for a blocking client: one call at a time,
    under :attr:`lock`; replies read through a buffer, so a frame's header and body mostly
    come in one receive."""

    _RECV_BYTES = 64 << 10

    def __init__(self, sock, max_reply_bytes: int) -> None:
        self._sock = sock
        self._max_reply_bytes = max_reply_bytes
        self._buffer = bytearray()
        self._last_id = OPENED_ID
        self._timeout_s: float | None = -1.0  # none set yet
        self.lock = threading.Lock()
        self.closed = False

    @classmethod
    def open(cls, sock, ticket: bytes, token: str | None, max_reply_bytes: int
             ) -> BlockingChannel:
        """Present ``ticket`` on the connected ``sock`` and wait for the daemon to open the
        channel; ChannelStatus with the daemon's reason where it refuses."""
        channel = cls(sock, max_reply_bytes)
        try:
            sock.sendall(framing.encode_hello(ticket, token))
            channel._reply(OPENED_ID, None)
        except BaseException:
            channel.close()
            raise
        return channel

    def call(self, method: str, request, timeout_s: float):
        """The response message of one call; ChannelStatus where it failed (the status its
        gRPC twin would end with), ChannelBroken where the channel did (then closed)."""
        if self.closed:
            raise ChannelBroken("the call channel is closed")
        self._last_id = self._last_id % MAX_REQUEST_ID + 1
        frame = framing.encode_call(method, self._last_id, request.SerializeToString(),
                                    request_metadata())
        try:
            if timeout_s != self._timeout_s:  # each settimeout is a syscall or two
                self._sock.settimeout(timeout_s)
                self._timeout_s = timeout_s
            self._sock.sendall(frame)
            return self._reply(self._last_id, REPLY_TYPES[method])
        except TimeoutError:
            # the reply may still come: a channel whose stream is not at a frame's start is
            # of no further use
            self.close()
            raise ChannelStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except ChannelBroken:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise ChannelBroken(f"the call channel failed: {exc}") from exc

    def _reply(self, request_id: int, reply_type):
        while True:
            length, status, got = reply_header(self._read(FRAME.size), self._max_reply_bytes)
            body = self._read(length)
            if got == request_id:
                return read_reply(status, body, reply_type)

    def _read(self, num_bytes: int) -> bytes:
        buffer = self._buffer
        while len(buffer) < num_bytes:
            chunk = self._sock.recv(max(self._RECV_BYTES, num_bytes - len(buffer)))
            if not chunk:
                raise ChannelBroken("the daemon closed the call channel")
            buffer += chunk
        data = bytes(buffer[:num_bytes])
        del buffer[:num_bytes]
        return data

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


class AsyncChannel:
    """A call channel (``kvstore.rpc.framing``) for an asyncio client: calls in flight at
    once, their replies matched by request id by one reader task."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_reply_bytes: int) -> None:
        self._reader, self._writer = reader, writer
        self._max_reply_bytes = max_reply_bytes
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._last_id = OPENED_ID
        self._task = asyncio.get_running_loop().create_task(self._read_replies())
        self.closed = False

    @classmethod
    async def open(cls, address: DataAddress, ticket: bytes, token: str | None,
                   timeout_s: float, max_reply_bytes: int) -> AsyncChannel:
        """Connect, present ``ticket`` and wait for the daemon to open the channel;
        ChannelStatus with the daemon's reason where it refuses."""
        async with asyncio.timeout(timeout_s):
            if address.family == socket.AF_UNIX:
                check_socket_path(address.address)
                reader, writer = await asyncio.open_unix_connection(address.address)
            else:
                reader, writer = await asyncio.open_connection(*address.address)
            try:
                writer.write(framing.encode_hello(ticket, token))
                length, status, _ = reply_header(await reader.readexactly(FRAME.size),
                                                 max_reply_bytes)
                read_reply(status, await reader.readexactly(length), None)
            except BaseException:
                writer.close()
                raise
        return cls(reader, writer, max_reply_bytes)

    async def call(self, method: str, request, timeout_s: float):
        """See ``BlockingChannel.call``; a timed-out call's late reply is dropped."""
        if self.closed:
            raise ChannelBroken("the call channel is closed")
        self._last_id = request_id = self._last_id % MAX_REQUEST_ID + 1
        reply = self._pending[request_id] = asyncio.get_running_loop().create_future()
        try:
            self._writer.write(framing.encode_call(method, request_id,
                                                   request.SerializeToString(),
                                                   request_metadata()))
            async with asyncio.timeout(timeout_s):
                await self._writer.drain()
                status, body = await reply
        except TimeoutError:
            raise ChannelStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as exc:
            self._fail(ChannelBroken(f"the call channel failed: {exc}"))
            raise ChannelBroken(f"the call channel failed: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)
            if reply.done() and not reply.cancelled():
                reply.exception()  # failed with the channel: what this call raised says so
        return read_reply(status, body, REPLY_TYPES[method])

    async def _read_replies(self) -> None:
        try:
            while True:
                length, status, request_id = reply_header(
                    await self._reader.readexactly(FRAME.size), self._max_reply_bytes)
                body = await self._reader.readexactly(length)
                reply = self._pending.get(request_id)
                if reply is not None and not reply.done():
                    reply.set_result((status, body))
        except (asyncio.IncompleteReadError, OSError) as exc:
            self._fail(exc if isinstance(exc, ChannelBroken) else
                       ChannelBroken(f"the daemon closed the call channel: {exc!r}"))

    def _fail(self, exc: ChannelBroken) -> None:
        self.closed = True
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(exc)
        self._writer.close()

    async def aclose(self) -> None:
        self.closed = True
        self._task.cancel()
        self._writer.close()
        await asyncio.gather(self._task, return_exceptions=True)


# ------------------------------------------------------------------------------ data socket


class DataSocket:
    """Whether a client moves tensor bytes over the daemon's data socket, and where to.

    On by default: a daemon that offers none says so (OpenPut refused, a Get header without a
    ticket) and the client streams chunks; a data socket it cannot connect to makes it stream
    for ``RETRY_S`` before it tries again. A transfer that fails once connected (the daemon
    dropped the connection: a full data socket under a flood) makes that one call stream
    (``fell_back``).
    """

    RETRY_S = 30.0

    def __init__(self, enabled: bool, target: Target, token: str | None,
                 timeout_s: float) -> None:
        self.token = token
        self._enabled = enabled
        self._target = target
        self._timeout_s = timeout_s
        self._retry_at = 0.0
        self.num_fallbacks = 0  # calls that streamed after their data transfer failed

    @property
    def usable(self) -> bool:
        return self._enabled and time.monotonic() >= self._retry_at

    def fell_back(self, what: str, exc: BaseException) -> None:
        """``what``'s transfer failed before the daemon took its bytes: it streams instead."""
        self.num_fallbacks += 1
        level = logging.WARNING if self.num_fallbacks in (1, 10, 100) \
            or self.num_fallbacks % 1000 == 0 else logging.DEBUG
        _log.log(level, "%s over the data socket failed (%s); streamed over gRPC instead "
                 "(%d calls so far)", what, exc, self.num_fallbacks)

    def refused(self) -> None:
        """The daemon offers no data socket to this client: stream for a while."""
        self._retry_at = time.monotonic() + self.RETRY_S

    def connect(self, ticket: pb.DataTicket) -> socket.socket | None:
        """A connection for ``ticket``'s transfer; None (and streaming for a while) when the
        data socket cannot be reached."""
        address = self._address(ticket)
        # Firewalled, or the daemon went: the ticket expires there on its own.
        with contextlib.suppress(OSError):
            if address is not None:
                return connect(address, self._timeout_s)
        self.refused()
        return None

    def _address(self, ticket: pb.DataTicket) -> DataAddress | None:
        return data_address(self._target, ticket)


def is_transfer_failure(exc: BaseException) -> bool:
    """Whether a data-socket Put's ``exc`` says its bytes never reached the store (the
    connection was dropped, or its ticket lapsed), so streaming the Put is safe."""
    return isinstance(exc, (DeadlineExceeded, Unavailable, LeaseNotFound))


def data_address(target: Target, ticket: pb.DataTicket) -> DataAddress | None:
    """Where this client connects to present ``ticket`` (None: not over its transport)."""
    if target.is_unix:
        return DataAddress(socket.AF_UNIX, ticket.unix_path) if ticket.unix_path else None
    if not ticket.tcp_port:
        return None
    host = target.grpc_target.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return DataAddress(family, (host, ticket.tcp_port))


def open_put_refused(err: grpc.RpcError, data: DataSocket) -> None:
    """None where a failed OpenPut means "stream this Put instead", else ``err`` re-raised.

    A daemon older than the data socket (UNIMPLEMENTED) or one that offers none to this
    caller (FAILED_PRECONDITION) makes the client stream for a while; one whose tickets are
    all taken (CapacityError, not a rate limit) makes it stream this one Put.
    """
    code = err.code() if hasattr(err, "code") else None
    if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
        data.refused()
        return
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and type(translate(err)) is CapacityError:
        return
    raise err
