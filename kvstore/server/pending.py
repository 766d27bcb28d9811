"""Connections that have not authenticated yet (no hello, no request): a small share of a
listener, a short deadline each, and room always made for the next one.

A stranger can open connections and say nothing. Refusing new connections once many wait
would lock out every client behind them (300 idle connections on the data port made every
transfer fail), so a full share makes room instead: the oldest waiting connection of the peer
holding the most is dropped. A real client sends its hello the moment it connects and leaves
this table within a turn of the event loop, so it is never the oldest; a flood only ever
pushes out its own connections, and each of them is dropped at its deadline anyway.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import OrderedDict

_log = logging.getLogger("kvstore.server.pending")

# accept() failing for want of descriptors or memory: wait this long and try again (the
# listening socket stays readable, so retrying at once would spin the loop).
ACCEPT_BACKOFF_S = 0.05
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class PendingConnections:
    """The waiting connections of one listener (or one socket's listeners), by peer.

    Args:
        max_pending: how many may wait at once; the next one drops the oldest of the peer
            holding the most.
        what: names the socket in the log ("data socket").
    """

    def __init__(self, max_pending: int, what: str) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._what = what
        self._by_peer: dict[str, OrderedDict[asyncio.Task, None]] = {}
        self._peer_of: dict[asyncio.Task, str] = {}
        self.num_dropped = 0  # waiting connections dropped to make room

    def __len__(self) -> int:
        return len(self._peer_of)

    def admit(self, peer: str, task: asyncio.Task) -> None:
        """``task`` serves a new connection from ``peer`` that must still authenticate; makes
        room first where the share is full."""
        while len(self._peer_of) >= self.max_pending:
            self.drop_one()
        self._by_peer.setdefault(peer, OrderedDict())[task] = None
        self._peer_of[task] = peer
        task.add_done_callback(self.settle)

    def settle(self, task: asyncio.Task) -> None:
        """``task``'s connection authenticated or ended: it no longer waits."""
        peer = self._peer_of.pop(task, None)
        if peer is None:
            return
        waiting = self._by_peer[peer]
        waiting.pop(task, None)
        if not waiting:
            del self._by_peer[peer]

    def drop_one(self) -> bool:
        """Drop the oldest waiting connection of the peer holding the most; False if none."""
        if not self._by_peer:
            return False
        peer = max(self._by_peer, key=lambda p: len(self._by_peer[p]))
        task = next(iter(self._by_peer[peer]))
        self.settle(task)
        task.cancel()  # its handler's ``with conn`` closes the socket
        self.num_dropped += 1
        if self.num_dropped in (1, 10, 100) or self.num_dropped % 1000 == 0:
            _log.warning("%s: %d connections that had not authenticated dropped to make room "
                         "(latest from %s)", self._what, self.num_dropped, peer)
        return True


async def accept(listener: socket.socket, pending: PendingConnections | None = None
                 ) -> tuple[socket.socket, object]:
    """The next connection on the non-blocking ``listener``. Out of descriptors, it drops a
    waiting connection (if any) and tries again shortly, instead of failing or spinning."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            return await loop.sock_accept(listener)
        except OSError as exc:
            if exc.errno not in _OUT_OF_RESOURCES:
                raise
            _log.warning("accept failed: %s; retrying in %g s", exc, ACCEPT_BACKOFF_S)
            if pending is not None:
                pending.drop_one()
            await asyncio.sleep(ACCEPT_BACKOFF_S)


def unix_peer(conn: socket.socket) -> str:
    """A Unix connection's peer process, ``pid:<pid>`` (SO_PEERCRED), for its share."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except OSError:
        return "pid:?"
    return f"pid:{int.from_bytes(creds[:4], 'little', signed=True)}"
