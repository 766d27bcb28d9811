"""TCP gRPC connections that have not authenticated: closed after a deadline, and beyond a
small share.

grpc's core owns the TCP listener and gives Python no hook at accept. Its handshake timeout
ends a connection only until the HTTP/2 preface and SETTINGS have arrived; after that a silent
connection is held for good, and 1,024 of them filled ``grpc.max_allowed_incoming_connections``
and locked every client out of the port. So the gate works from beside grpc: the auth
interceptor vouches for the peer address of every call that showed a valid token
(:meth:`TcpGate.vouch`), and a sweep every ``SWEEP_S`` lists the daemon's own sockets
(``/proc/self/fd``), finds the connections to the TCP gRPC port and shuts down those not vouched
for: each once it is ``server.unauthenticated_timeout_s`` old, and the oldest of the peer host
holding the most while more than the share (a quarter of the port's connections) wait. A shut
down socket (``shutdown(2)`` through a duplicate descriptor) reads as the peer gone to grpc,
which then closes the connection and frees its place. Unix-socket clients are never gated.

A flood that reconnects faster than the sweep runs can still fill the port between sweeps; a
client turned away then retries (its retry policy) and finds room after the next sweep.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass

_log = logging.getLogger("kvstore.server.gate")

SWEEP_S = 0.25  # how often the gate looks; a listing of a few thousand descriptors is ~1 ms


@dataclass(slots=True)
class _Conn:
    """What one socket of the daemon is, classified once per socket (its inode)."""

    first_seen: float
    peers: tuple[str, ...] = ()  # its peer as grpc names it; empty: not a TCP gRPC connection
    host: str = ""


class TcpGate:
    """Sweeps the TCP gRPC port of ``port`` (see the module docstring).

    Args:
        port: the bound TCP gRPC port.
        timeout_s: how long a connection may go without an authenticated call.
        max_unauthenticated: how many connections without one may be open at once.
    """

    def __init__(self, port: int, timeout_s: float, max_unauthenticated: int) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self.max_unauthenticated = max_unauthenticated
        # grpc peer string -> when it was last vouched for; written on the event loop, read
        # (atomic dict operations only) by the sweep's thread
        self._vouched: dict[str, float] = {}
        self._known: dict[int, _Conn] = {}  # socket inode -> what it is
        self.num_closed = 0

    def vouch(self, peer: str) -> None:
        """A call from ``peer`` (grpc's ``ipv4:10.0.0.1:5000``) showed a valid token."""
        if not peer.startswith("unix"):
            self._vouched[peer] = time.monotonic()

    async def run(self) -> None:
        """Sweep every ``SWEEP_S`` until cancelled (the listing runs in a worker thread)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await asyncio.to_thread(self.sweep)
            except OSError as exc:  # out of descriptors for the listing: try next time
                _log.warning("connection sweep failed: %s", exc)

    def sweep(self) -> int:
        """Shut down the connections due; how many."""
        now = time.monotonic()
        live = _sockets()
        for inode in self._known.keys() - live.keys():
            del self._known[inode]
        waiting: list[tuple[float, str, int, int]] = []  # (first seen, host, inode, fd)
        peers_seen: set[str] = set()
        for inode, fd in live.items():
            conn = self._known.get(inode)
            if conn is None:
                conn = self._known[inode] = self._classify(fd, inode, now)
            if not conn.peers:
                continue
            peers_seen.update(conn.peers)
            if not any(p in self._vouched for p in conn.peers):
                waiting.append((conn.first_seen, conn.host, inode, fd))
        for peer, stamp in list(self._vouched.items()):
            if stamp < now and peer not in peers_seen:  # its connection is gone
                self._vouched.pop(peer, None)
        due = [w for w in waiting if now - w[0] >= self.timeout_s]
        young = sorted(w for w in waiting if now - w[0] < self.timeout_s)
        due += _oldest_of_largest(young, len(young) - self.max_unauthenticated)
        for _, host, inode, fd in due:
            self.num_closed += _shut(fd, inode)
        if due:
            _log.info("closed %d TCP connections that made no authenticated call (%d so far; "
                      "latest from %s)", len(due), self.num_closed, due[-1][1])
        return len(due)

    def _classify(self, fd: int, inode: int, now: float) -> _Conn:
        conn = _Conn(now)
        sock = _dup(fd, inode)
        if sock is None:
            return conn
        with sock:
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6) \
                        or sock.getsockname()[1] != self.port:
                    return conn
                host, port = sock.getpeername()[:2]  # the listener has none: ENOTCONN
            except OSError:
                return conn
        v4 = host.removeprefix("::ffff:")
        if sock.family == socket.AF_INET:
            conn.peers = (f"ipv4:{host}:{port}",)
        else:
            conn.peers = (f"ipv6:[{host}]:{port}",) + (
                (f"ipv4:{v4}:{port}",) if v4 != host else ())
        conn.host = v4
        return conn


def _oldest_of_largest(waiting: list[tuple[float, str, int, int]], excess: int
                       ) -> list[tuple[float, str, int, int]]:
    """``excess`` of ``waiting`` (oldest first), each the oldest of the host holding most."""
    by_host: dict[str, list[tuple[float, str, int, int]]] = {}
    for entry in waiting:
        by_host.setdefault(entry[1], []).append(entry)
    picked = []
    for _ in range(max(0, excess)):
        host = max(by_host, key=lambda h: len(by_host[h]))
        picked.append(by_host[host].pop(0))
        if not by_host[host]:
            del by_host[host]
    return picked


def _sockets() -> dict[int, int]:
    """This process's sockets: inode -> a descriptor of it."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since the listing
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(name)
    return found


def _dup(fd: int, inode: int) -> socket.socket | None:
    """A duplicate of ``fd`` as a socket, if it still is socket ``inode`` (descriptors are
    reused: the number alone may name another file by now)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino == inode:
            return socket.socket(fileno=dup)
    except OSError:
        pass
    os.close(dup)
    return None


def _shut(fd: int, inode: int) -> int:
    """Shut socket ``inode`` down both ways (grpc then closes its descriptor); 1 if done."""
    sock = _dup(fd, inode)
    if sock is None:
        return 0
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return 0
    return 1
