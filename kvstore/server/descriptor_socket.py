"""The descriptor socket: hands a same-host client the memfd of its own tenant's DRAM arena.

A Unix socket beside the gRPC one (the exchange is in ``kvstore.rpc.descriptors``). A client
is told a region by a lease or reservation; here it proves who it is with its bearer token
(the daemon's one ``kvstore.server.auth.Authenticator``, as for a gRPC call) and gets that
region's descriptor only if the region belongs to its tenant. Every read of a request is
bounded in size and time, connections are bounded in number, and nothing blocks the event loop.
A flood of connections that send nothing cannot keep a client out: a full socket drops the
oldest waiting connection of the process holding the most (``pending.py``), never the newest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct

from kvstore.config import ServerConfig
from kvstore.errors import InvalidArgument, KVStoreError, NotFound, shown
from kvstore.rpc.descriptors import (
    MAX_MESSAGE_BYTES,
    encode_grant,
    encode_refusal,
    parse_request,
)
from kvstore.server.auth import UNIX_PEER_PREFIX, Authenticator
from kvstore.server.pending import PendingConnections, accept
from kvstore.server.sockets import bind_unix
from kvstore.tiers.base import FdRegions

_log = logging.getLogger("kvstore.server.descriptor_socket")

REQUEST_TIMEOUT_S = 2.0  # a client that has not sent its whole request by then is dropped
MAX_CONNECTIONS = 64  # exchanges in flight; one more drops the oldest waiting
LISTEN_BACKLOG = 128
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class DescriptorServer:
    """Serves arena descriptors on ``path`` for the regions of ``regions``.

    Args:
        path: the socket to listen on (``kvstore.rpc.descriptors.fd_socket_path``), in the gRPC
            socket's directory, with the gRPC socket's mode (``server.socket_mode``, 0600 by
            default): whoever may call Reserve and Acquire may ask for their tenant's arena,
            and the token check here is what keeps tenants apart.
        config: the daemon's server config (``socket_mode``).
        auth: the daemon's one token table, shared with its gRPC calls.
        regions: the slot tier whose regions it hands out.
        max_connections: exchanges in flight at once (``fds.ConnectionBudget``).
    """

    def __init__(self, path: str, config: ServerConfig, auth: Authenticator,
                 regions: FdRegions, max_connections: int = MAX_CONNECTIONS) -> None:
        self.path = path
        self._auth = auth
        self._mode = config.socket_mode
        self._regions = regions
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._exchanges: set[asyncio.Task[None]] = set()
        # Every exchange waits for its request until answered: all of them are pending.
        self.pending = PendingConnections(max_connections, "descriptor socket")
        self._timeout_s = min(REQUEST_TIMEOUT_S, config.unauthenticated_timeout_s)

    async def start(self) -> None:
        """Bind and listen (replacing a stale socket file of a daemon that died)."""
        listener = bind_unix(self.path, self._mode, "descriptor socket")
        # a burst queues in the kernel (no descriptor of ours) rather than failing to connect
        listener.listen(max(LISTEN_BACKLOG, self.pending.max_pending))
        listener.setblocking(False)
        self._listener = listener
        self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def close(self) -> None:
        """Stop accepting, drop exchanges in flight and remove the socket file. Idempotent."""
        tasks = [t for t in (self._accepting, *self._exchanges) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await accept(self._listener, self.pending)
            task = loop.create_task(self._exchange(conn))
            self._exchanges.add(task)
            task.add_done_callback(self._exchanges.discard)
            # a full socket drops its oldest waiting exchange (that client streams instead)
            self.pending.admit(f"pid:{_peer(conn)[0]}", task)

    async def _exchange(self, conn: socket.socket) -> None:
        with conn:
            conn.setblocking(False)
            pid, uid = _peer(conn)
            try:
                line = await asyncio.wait_for(_read_line(conn), self._timeout_s)
                reply, fds = self._answer(line, pid, uid)
            except TimeoutError:  # common under a flood: not a warning
                _log.debug("descriptor request from pid %d timed out", pid)
                return
            except KVStoreError as exc:
                _log.warning("refused an arena descriptor to pid %d (uid %d): %s", pid, uid, exc)
                reply, fds = encode_refusal(exc), []
            except OSError as exc:  # the client went away
                _log.debug("descriptor exchange with pid %d failed: %s", pid, exc)
                return
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(_send(conn, reply, fds), REQUEST_TIMEOUT_S)

    def _answer(self, line: bytes, pid: int, uid: int) -> tuple[bytes, list[int]]:
        """The reply to one request line and the descriptors to send with it."""
        region, token = parse_request(line)
        caller = self._auth.caller_of_token(token, UNIX_PEER_PREFIX)
        if not region:
            return encode_grant(caller.tenant or "", ""), []
        found = self._regions.region_fd(region)
        if found is None:
            raise NotFound(f"no arena region {shown(region)} (the daemon restarted, or it "
                           "was never handed out)")
        tenant, fd = found
        caller.check_tenant(tenant, "map the arena of tenant")
        _log.debug("sent arena %s of tenant %s to pid %d (uid %d)", region, shown(tenant), pid,
                   uid)
        return encode_grant(tenant, region), [fd]


async def _read_line(conn: socket.socket) -> bytes:
    """Bytes up to and including the first newline; InvalidArgument past the size bound."""
    loop = asyncio.get_running_loop()
    data = b""
    while not data.endswith(b"\n"):
        chunk = await loop.sock_recv(conn, MAX_MESSAGE_BYTES - len(data))
        if not chunk:
            raise InvalidArgument("descriptor request ended before its newline")
        data += chunk
        if len(data) >= MAX_MESSAGE_BYTES and not data.endswith(b"\n"):
            raise InvalidArgument(f"descriptor request longer than {MAX_MESSAGE_BYTES} bytes")
        if b"\n" in data[:-1]:
            raise InvalidArgument("descriptor request must be one line")
    return data


async def _send(conn: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send ``data`` with ``fds`` attached to its first byte, waiting (never blocking) while the
    socket is full."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            sent = socket.send_fds(conn, [data], fds)
            break
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(conn.fileno(), ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_writer(conn.fileno())
    if sent < len(data):
        await loop.sock_sendall(conn, data[sent:])


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The connecting process's pid and uid (SO_PEERCRED), for the log."""
    try:
        pid, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       _PEERCRED.size))
    except OSError:
        return -1, -1
    return pid, uid
