"""The data socket: its listeners, and each connection moving a ticket's bytes or calls.

The wire format is in ``kvstore.rpc.framing``, the tickets in ``transfers.py``. A connection
presents a ticket in its hello and then moves exactly that ticket's bytes (a Put's into the
buffer set aside, a Get's from the pieces the store returned); the gRPC call that owns the
ticket waits for that and answers.

What a hostile client can make the daemon hold here is bounded: a connection must send its
hello within ``server.unauthenticated_timeout_s`` and keep moving at least
``MIN_PROGRESS_BYTES`` per ``server.stream_idle_timeout_s``; a connection that ends early or
sends more than declared fails its transfer. Connections still waiting for their hello hold a
quarter of the listeners' connections at most, a full share dropping the oldest of the peer
holding the most (``pending.py``), so a flood of silent connections cannot keep a client's
hello out. Nothing blocks the event loop.

A ticket from OpenChannel turns its data connection into a call channel instead
(``server/channel.py``): long-lived, bound to the caller and session the ticket went to, at
most ``MAX_CHANNELS_PER_TENANT`` open per tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence

from kvstore.config import ServerConfig
from kvstore.errors import (
    CapacityError,
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    Unavailable,
    shown,
)
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.framing import HELLO, OPENED_ID, encode_frame, parse_hello, widen_buffers
from kvstore.rpc.status import status_for
from kvstore.server.auth import UNIX_PEER_PREFIX, Authenticator, Caller
from kvstore.server.channel import (
    CallScope,
    ChannelCalls,
    FrameBudget,
    error_reply,
    serve_channel,
)
from kvstore.server.heap import HEAP
from kvstore.server.limits import MIN_PROGRESS_BYTES
from kvstore.server.pending import PendingConnections, accept, unix_peer
from kvstore.server.sessions import Session
from kvstore.server.slow_readers import ReplyBudget, ReplyQueue
from kvstore.server.sockets import bind_unix
from kvstore.server.transfers import ChannelTicket, Transfer, Transfers, peer_of

_log = logging.getLogger("kvstore.server.data_socket")
SEND_SLICE_BYTES = 4 << 20  # a Get is sent in slices, each within the idle bound
MAX_IOV = 1024  # buffers per sendmsg (Linux's IOV_MAX)

# A blocking client opens up to two call channels (its caller's and its late Releases'
# worker's), an async one one; an engine's scheduler and each of its workers hold a client, so
# a tenant of a TP-8 engine needs about 20 per host. Each is a task and a connection the daemon
# keeps.
MAX_CHANNELS_PER_TENANT = 64
# Request bodies one tenant's channels may hold in flight together, in largest requests: a
# tenant's 64 channels of 64 frames could otherwise hold 4096 of them (16 GiB at 4 MiB each).
CHANNEL_FRAMES_PER_TENANT = 4
_CLOSE_WAIT_S = 1.0  # how long a closing channel may take to flush its last replies


class DataSocketServer:
    """The data socket's listeners, the connections they take, and the tickets those present.

    Args:
        config: the daemon's server config (timeouts, ``max_data_transfers``).
        auth: the daemon's one token table, shared with its gRPC calls.
        unix_path: the data socket beside the gRPC one (``rpc.framing.data_socket_path``).
        max_pending_bytes: the most bytes all live tickets may hold together.
        max_connections: the most connections one listener holds (``fds.ConnectionBudget``);
            0: ``server.max_connections``.
    """

    def __init__(self, config: ServerConfig, auth: Authenticator, unix_path: str,
                 max_pending_bytes: int, max_connections: int = 0) -> None:
        self.unix_path = unix_path
        self.tcp_port: int | None = None
        self._auth = auth
        self._idle_s = config.stream_idle_timeout_s
        self._max_transfers = config.max_data_transfers
        self._hello_s = min(self._idle_s, config.unauthenticated_timeout_s)
        self._max_connections = max_connections or config.max_connections
        # Waiting hellos share a quarter of one listener's connections (both listeners' waits
        # count together: a peer floods whichever it reaches).
        self.pending = PendingConnections(max(2, self._max_connections // 4), "data socket")
        self.transfers = Transfers(self._idle_s, self._max_transfers, max_pending_bytes)
        self.bytes_moved = 0  # by transfers that completed, either way
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self._calls: ChannelCalls | None = None  # None: no call channels
        self._max_frame_bytes = 0
        self._channels: dict[str | None, int] = {}  # tenant -> call channels open
        self._budgets: dict[str | None, FrameBudget] = {}  # tenant -> its frames' bytes
        self._max_channel_reply_bytes = config.max_channel_reply_bytes
        self._max_tenant_reply_bytes = config.max_tenant_reply_bytes
        self._replies: dict[str | None, ReplyBudget] = {}  # tenant -> its unsent replies
        self.num_channels_closed_unread = 0  # channels closed for replies not read
        self.reply_bytes_dropped = 0  # unsent replies those held

    @property
    def unsent_reply_bytes(self) -> int:
        """Reply bytes queued on call channels and not yet read, all tenants together."""
        return sum(budget.unsent_bytes for budget in self._replies.values())

    @property
    def num_transfers(self) -> int:
        return self.transfers.num_transfers

    @property
    def pending_bytes(self) -> int:
        return self.transfers.pending_bytes

    @property
    def pooled_bytes(self) -> int:
        """Idle Put buffers kept for reuse."""
        return self.transfers.pooled_bytes

    def offer_calls(self, calls: ChannelCalls, max_frame_bytes: int) -> None:
        """Serve call channels whose frames make ``calls``, request bodies of at most
        ``max_frame_bytes``."""
        self._calls, self._max_frame_bytes = calls, max_frame_bytes

    @property
    def calls(self) -> ChannelCalls | None:
        """What call channels' frames make (None: no call channels)."""
        return self._calls

    @property
    def offers_calls(self) -> bool:
        return self._calls is not None

    @property
    def num_channels(self) -> int:
        """Call channels open now."""
        return sum(self._channels.values())

    def open_channel(self, caller: Caller, peer: str, session: Session | None) -> Transfer:
        """A ticket that opens a call channel for ``caller`` over ``peer``'s transport, its
        calls granted under ``session``."""
        if self._calls is None:
            raise FailedPrecondition("this daemon serves no call channels (server.call_channel)"
                                     "; make the calls over gRPC")
        self._check_channels(caller)
        return self.transfers.open_channel(caller, peer, session)

    def _check_channels(self, caller: Caller) -> None:
        count = self._channels.get(caller.tenant, 0)
        if count >= MAX_CHANNELS_PER_TENANT:
            raise CapacityError(f"tenant {shown(caller.tenant)} holds {count} call channels, "
                                "the most one tenant may; make the calls over gRPC")

    def serves(self, peer: str) -> bool:
        """Whether a caller at ``peer`` can reach a data socket of this daemon."""
        return peer.startswith(UNIX_PEER_PREFIX) or self.tcp_port is not None

    def ticket_proto(self, transfer: Transfer) -> pb.DataTicket:
        wall_deadline = time.time() + transfer.deadline - asyncio.get_running_loop().time()
        return pb.DataTicket(ticket=transfer.ticket, total_bytes=transfer.total_bytes,
                             unix_path=self.unix_path if transfer.transport == "unix" else "",
                             tcp_port=0 if transfer.transport == "unix" else self.tcp_port or 0,
                             deadline=wall_deadline)

    # ---------------------------------------------------------------------------- listeners

    async def start(self, tcp_host: str | None, tcp_port: int, socket_mode: int) -> None:
        """Listen on the Unix data socket and, with ``tcp_host``, on ``tcp_port`` there."""
        unix = bind_unix(self.unix_path, socket_mode, "data socket")
        self._listen(unix, "unix")
        if tcp_host is not None:
            family = socket.AF_INET6 if ":" in tcp_host else socket.AF_INET
            tcp = socket.socket(family, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                tcp.bind((tcp_host, tcp_port))
            except OSError as exc:
                tcp.close()
                raise ConfigError(f"server.data_port {tcp_port} on {tcp_host}: cannot bind: "
                                  f"{exc}") from None
            self.tcp_port = tcp.getsockname()[1]
            self._listen(tcp, "tcp")

    def _listen(self, listener: socket.socket, kind: str) -> None:
        listener.listen(min(self._max_transfers, 1024))
        listener.setblocking(False)
        self._listeners.append(listener)
        self._spawn(self._accept(listener, kind))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Stop listening, end transfers in flight, remove the socket file. Idempotent."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for listener in self._listeners:
            listener.close()
        if self._listeners:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
        self._listeners = []
        self.transfers.discard_all()

    async def _accept(self, listener: socket.socket, kind: str) -> None:
        while True:
            conn, address = await accept(listener, self.pending)
            if not self._make_room():
                conn.close()  # every connection has shown a ticket: none of them is a stranger's
                continue
            transport = "unix" if kind == "unix" else address[0].removeprefix("::ffff:")
            peer = unix_peer(conn) if kind == "unix" else transport
            self.pending.admit(peer, self._spawn(self._serve(conn, transport)))

    def _make_room(self) -> bool:
        """Whether one more connection fits: within the listeners' connections, and within
        what tickets can exist (not counting channels); a waiting connection is dropped where
        that makes it fit."""
        num_listeners = len(self._listeners)
        while True:
            num_conns = len(self._tasks) - num_listeners
            if (num_conns < self._max_connections * num_listeners
                    and num_conns - self.num_channels <= self._max_transfers):
                return True
            if not self.pending.drop_one():
                return False

    # ---------------------------------------------------------------------------- transfers

    async def _serve(self, conn: socket.socket, transport: str) -> None:
        with conn:
            conn.setblocking(False)
            try:
                transfer = await asyncio.wait_for(self._hello(conn, transport), self._hello_s)
            except TimeoutError:  # a stranger's silence is common under a flood: not a warning
                _log.debug("dropped a data connection over %s: no hello within %g s "
                           "(server.unauthenticated_timeout_s)", transport, self._hello_s)
                return
            except (KVStoreError, OSError) as exc:
                _log.warning("refused a data connection over %s: %s", transport, exc)
                return
            finally:
                self.pending.settle(asyncio.current_task())
            if transfer is None:
                return
            transfer.task = asyncio.current_task()
            if isinstance(transfer.context, ChannelTicket):
                self.transfers.discard(transfer)  # spent: its place among the tickets goes back
                await self._serve_channel(conn, transfer, transport)
                return
            widen_buffers(conn)
            try:
                if transfer.is_put:
                    await self._receive(conn, transfer)
                else:
                    await self._send(conn, transfer)
            except KVStoreError as exc:
                transfer.finish(exc)
            except TimeoutError:  # before OSError, of which it is a kind
                transfer.finish(DeadlineExceeded(
                    f"the data connection moved under {MIN_PROGRESS_BYTES} bytes in "
                    f"{self._idle_s:g} s (server.stream_idle_timeout_s); it was dropped"))
            except OSError as exc:
                transfer.finish(Unavailable(f"the data connection failed: {exc}"))
            except asyncio.CancelledError:
                transfer.finish(Unavailable("the daemon is shutting down"))
                raise
            else:
                transfer.finish(None)
                self.bytes_moved += transfer.total_bytes
            # An unclaimed transfer (a Put whose call has not come yet) stays until its call
            # takes it or it expires, so that call can still say how it ended.

    async def _hello(self, conn: socket.socket, transport: str) -> Transfer | None:
        """The transfer a connection's hello presents, spent from now on; None (logged) if
        the ticket names none; the presenting caller's error if it may not take it."""
        ticket, token_bytes = parse_hello(await _recv_exactly(conn, HELLO.size))
        token = (await _recv_exactly(conn, token_bytes)).decode("utf-8", "replace")
        transfer = self.transfers.present(ticket)  # single use, whoever presented it
        if transfer is None:
            _log.warning("a data connection over %s presented an unknown or spent ticket",
                         transport)
            return None
        try:
            if transfer.transport != transport:
                raise PermissionDenied(f"the data ticket was issued over {transfer.transport} "
                                       f"and presented over {transport}")
            caller = self._auth.caller_of_token(token, peer_of(transport))
            if caller != transfer.caller:
                raise PermissionDenied("the data ticket was issued to another caller")
        except KVStoreError as exc:
            transfer.finish(exc)  # its call reports who presented it wrongly
            if isinstance(transfer.context, ChannelTicket):  # nobody else will say why
                await _refuse(conn, exc, self._idle_s)
            raise
        return transfer

    async def _serve_channel(self, conn: socket.socket, transfer: Transfer,
                             transport: str) -> None:
        """Serve ``conn`` as a call channel of the ticket's caller until it ends."""
        tenant = transfer.caller.tenant
        try:
            self._check_channels(transfer.caller)  # tickets may outnumber the room left
        except CapacityError as exc:
            await _refuse(conn, exc, self._idle_s)
            return
        calls = self._calls
        if calls is None:
            return
        self._channels[tenant] = self._channels.get(tenant, 0) + 1
        budget = self._budgets.get(tenant)
        if budget is None:
            budget = self._budgets[tenant] = FrameBudget(
                CHANNEL_FRAMES_PER_TENANT * self._max_frame_bytes)
        replies = self._replies.get(tenant)
        if replies is None:
            replies = self._replies[tenant] = ReplyBudget(self._max_tenant_reply_bytes)
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
            scope = CallScope(transfer.caller, peer_of(transport),
                              session=transfer.context.session)
            queue = ReplyQueue(writer, replies, self._max_channel_reply_bytes, self._idle_s,
                               self._closed_unread)
            try:
                await serve_channel(reader, writer, calls, scope, self._max_frame_bytes,
                                    self._idle_s, budget, queue)
            finally:
                writer.close()
                try:
                    async with asyncio.timeout(_CLOSE_WAIT_S):
                        await writer.wait_closed()
                except (TimeoutError, OSError):
                    writer.transport.abort()  # a client that reads nothing: drop its replies
                    await asyncio.sleep(0)  # the transport lets go of the socket first
        finally:
            left = self._channels[tenant] - 1
            if left:
                self._channels[tenant] = left
            else:  # its last channel's calls have ended: nothing of its budget is held
                del self._channels[tenant]
                self._budgets.pop(tenant, None)
                self._replies.pop(tenant, None)

    def _closed_unread(self, dropped_bytes: int) -> None:
        self.num_channels_closed_unread += 1
        self.reply_bytes_dropped += dropped_bytes
        HEAP.note_freed(dropped_bytes)

    async def _receive(self, conn: socket.socket, transfer: Transfer) -> None:
        """Read exactly the transfer's bytes into its buffer, then the client's end."""
        loop = asyncio.get_running_loop()
        view, total, pos = transfer.buffer, transfer.total_bytes, 0
        clock = _Progress(self._idle_s, loop)
        while pos < total:
            async with asyncio.timeout_at(clock.deadline):
                got = await loop.sock_recv_into(conn, view[pos:])
            if not got:
                raise InvalidArgument(f"the data connection ended after {pos} of {total} "
                                      "declared bytes")
            pos += got
            clock.note(got)
        async with asyncio.timeout_at(clock.deadline):
            extra = await loop.sock_recv(conn, 1)
        if extra:
            raise InvalidArgument(f"the data connection sent more than the {total} bytes "
                                  "declared")

    async def _send(self, conn: socket.socket, transfer: Transfer) -> None:
        loop = asyncio.get_running_loop()
        for batch in _slices(transfer.pieces or (), SEND_SLICE_BYTES):
            # each slice must leave within the idle bound: a reader that stalls is dropped
            async with asyncio.timeout(self._idle_s):
                await _send_all(loop, conn, batch)


def _slices(pieces: Sequence[memoryview], slice_bytes: int) -> Iterator[list[memoryview]]:
    """``pieces`` in batches of about ``slice_bytes`` (a piece is never split) and at most
    ``MAX_IOV`` pieces, one ``sendmsg`` each while the socket takes them."""
    batch: list[memoryview] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= slice_bytes or len(batch) == MAX_IOV:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


async def _send_all(loop: asyncio.AbstractEventLoop, conn: socket.socket,
                    buffers: list[memoryview]) -> None:
    """Send ``buffers`` in order on the non-blocking ``conn``: gathered (``sendmsg``, one
    system call for many pages) until the socket is full, then waiting until it drains."""
    first = 0
    while first < len(buffers):
        try:
            sent = conn.sendmsg(buffers[first:first + MAX_IOV])
        except (BlockingIOError, InterruptedError):
            await _writable(loop, conn)
            continue
        while sent and first < len(buffers):
            size = len(buffers[first])
            if sent >= size:
                sent -= size
                first += 1
            else:
                buffers[first] = buffers[first][sent:]
                sent = 0


async def _writable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(fd)


class _Progress:
    """The deadline by which a data connection must next have moved ``MIN_PROGRESS_BYTES``."""

    def __init__(self, idle_s: float, loop: asyncio.AbstractEventLoop) -> None:
        self._idle_s, self._loop = idle_s, loop
        self._since = 0
        self.deadline = loop.time() + idle_s

    def note(self, num_bytes: int) -> None:
        self._since += num_bytes
        if self._since >= MIN_PROGRESS_BYTES:
            self._since = 0
            self.deadline = self._loop.time() + self._idle_s


async def _refuse(conn: socket.socket, exc: KVStoreError, idle_s: float) -> None:
    """Answer a channel's hello with the error that refused it (the client raises it)."""
    code, body = error_reply(status_for(exc), exc)
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(idle_s):
            await asyncio.get_running_loop().sock_sendall(conn, encode_frame(code, OPENED_ID,
                                                                             body))


async def _recv_exactly(conn: socket.socket, num_bytes: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < num_bytes:
        chunk = await loop.sock_recv(conn, num_bytes - len(data))
        if not chunk:
            raise InvalidArgument("the data connection ended inside its hello")
        data += chunk
    return data
