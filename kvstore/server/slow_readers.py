"""What a reader that stops reading may make the daemon hold: call-channel replies queued and
not yet sent, and a streamed response (a Get's chunks) whose next message waits.

Replies on a call channel (``server/channel.py``) go into its connection's write buffer. A
:class:`ReplyQueue` bounds that buffer by ``server.max_channel_reply_bytes`` and, with the other
channels of its tenant (one :class:`ReplyBudget`), by ``server.max_tenant_reply_bytes``; a reply
that would pass either closes the channel (its queued replies are dropped; the client calls
over gRPC, as when a channel breaks). A channel whose client reads under ``MIN_PROGRESS_BYTES``
of its replies in ``server.stream_idle_timeout_s`` while some wait is closed too. One reply on
an otherwise empty queue always fits, so a legitimate client's largest reply is never refused.

A streamed gRPC response (:func:`paced`) must have each message taken within the idle bound;
a stream whose reader stalls is ended with DEADLINE_EXCEEDED and its handler closed, so what
it held (a Get's result, its pinned pages) is let go at once, not when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from kvstore.server.limits import MIN_PROGRESS_BYTES

_log = logging.getLogger("kvstore.server.slow_readers")
T = TypeVar("T")


class ReplyBudget:
    """The unsent reply bytes of one tenant's call channels together, at most ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.queues: set[ReplyQueue] = set()

    @property
    def unsent_bytes(self) -> int:
        return sum(queue.unsent_bytes for queue in self.queues)


class ReplyQueue:
    """The replies of one call channel on their way to its client (see the module docstring).

    Args:
        writer: the channel's connection.
        budget: its tenant's, shared by that tenant's channels.
        max_bytes: the most unsent reply bytes this channel may queue.
        idle_s: how long replies may wait without the client reading some.
        on_closed: called with the bytes dropped when a bound closes the channel.
    """

    def __init__(self, writer: asyncio.StreamWriter, budget: ReplyBudget, max_bytes: int,
                 idle_s: float, on_closed: Callable[[int], None] = lambda _: None) -> None:
        self._writer, self._budget = writer, budget
        self.max_bytes, self._idle_s, self._on_closed = max_bytes, idle_s, on_closed
        self._written = 0  # bytes handed to the connection, since it opened
        self._mark = (0, 0)  # (bytes sent, bytes unsent) when progress was last looked at
        self._timer: asyncio.TimerHandle | None = None
        self.closed_why: str | None = None  # set when a bound closed the channel
        budget.queues.add(self)

    @property
    def unsent_bytes(self) -> int:
        """Reply bytes written and not yet taken by the connection's socket."""
        return self._writer.transport.get_write_buffer_size()

    def send(self, frame: bytes) -> bool:
        """Queue ``frame``; False where the channel is closed, or is now, because the frame
        would pass this channel's or its tenant's bound."""
        if self._writer.is_closing():
            return False
        unsent, tenant_unsent = self.unsent_bytes, self._budget.unsent_bytes
        if unsent and unsent + len(frame) > self.max_bytes:
            return self._close(f"a reply of {len(frame)} bytes would pass the "
                               f"{self.max_bytes} bytes its client has not read "
                               "(server.max_channel_reply_bytes)")
        if tenant_unsent and tenant_unsent + len(frame) > self._budget.max_bytes:
            return self._close(f"a reply of {len(frame)} bytes would pass the "
                               f"{self._budget.max_bytes} bytes its tenant's channels have "
                               "not read (server.max_tenant_reply_bytes)")
        self._writer.write(frame)
        self._written += len(frame)
        if self._timer is None and self.unsent_bytes:
            self._watch()
        return True

    def close(self) -> None:
        """The channel has ended: stop watching it and leave its tenant's budget."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._budget.queues.discard(self)

    def _watch(self) -> None:
        unsent = self.unsent_bytes
        self._mark = (self._written - unsent, unsent)
        self._timer = asyncio.get_running_loop().call_later(self._idle_s, self._look)

    def _look(self) -> None:
        """Replies have waited ``idle_s``: go on watching while the client reads them."""
        self._timer = None
        unsent = self.unsent_bytes
        if self._writer.is_closing() or not unsent:
            return
        sent_then, unsent_then = self._mark
        if self._written - unsent - sent_then >= min(MIN_PROGRESS_BYTES, unsent_then):
            self._watch()
            return
        self._close(f"its client read under {MIN_PROGRESS_BYTES} bytes of its replies in "
                    f"{self._idle_s:g} s (server.stream_idle_timeout_s) while {unsent} waited")

    def _close(self, why: str) -> bool:
        dropped = self.unsent_bytes
        self.closed_why = why
        _log.warning("closed a call channel: %s", why)
        self._writer.transport.abort()  # close() would keep the replies until they are read
        self.close()
        self._on_closed(dropped)
        return False


async def paced(messages: AsyncIterator[T], context: grpc.aio.ServicerContext, idle_s: float,
                what: str) -> AsyncIterator[T]:
    """``messages``, each of which its reader must take within ``idle_s``.

    A message still waiting after that ends the call with DEADLINE_EXCEEDED: the status is
    sent (its reader sees it once it reads again) and the handler's task is cancelled, which
    closes ``messages`` (running its ``finally``) and frees what the call held at once. A
    task is cancelled because the wait is grpc's, outside this generator: a timeout here
    could not reach it.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    detail = (f"{what}: its reader took no message for {idle_s:g} s "
              "(server.stream_idle_timeout_s); the stream was ended")

    def stalled() -> None:
        _log.warning("ended a stream: %s", detail)
        loop.create_task(_abort_quietly(context, detail))
        if task is not None:
            task.cancel()

    try:
        async for message in messages:
            timer = loop.call_later(idle_s, stalled)
            try:
                yield message
            finally:
                timer.cancel()
    finally:
        with contextlib.suppress(RuntimeError):  # already closing: its finally has run
            await messages.aclose()


async def _abort_quietly(context: grpc.aio.ServicerContext, detail: str) -> None:
    """Send a stalled stream's status. ``abort`` raises by design; from this task nobody
    catches that, so it is swallowed here."""
    with contextlib.suppress(Exception):
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, detail)
