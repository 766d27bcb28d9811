"""Data tickets: one-time grants to move a Put's or Get's bytes, and what they may hold.

A gRPC handler (``service.py``) that did everything a streamed call does first
(authentication, validation, sizes, quotas) asks here for a :class:`Transfer`: a ticket bound
to the caller and the transport it called on, a buffer of known size set aside (Put:
``torch.empty`` from a :class:`BufferPool`, never zero-filled; Get: the pieces the store
returned) and a deadline. The data socket (``data_socket.py``) moves the bytes of a ticket a
connection presents; the handler waits for that and answers the call.

What a hostile client can make the daemon hold is bounded: live tickets by
``server.max_data_transfers`` and their bytes by a budget (the largest Put, as for a streamed
Put), each tenant holding fewer of either than are left free; a ticket nobody presents is
dropped at its deadline. A presented ticket is spent, whatever happens next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import unquote

import torch

from kvstore.errors import (
    CapacityError,
    DeadlineExceeded,
    KVStoreError,
    LeaseNotFound,
    PermissionDenied,
    Unavailable,
    shown,
)
from kvstore.rpc.framing import TICKET_BYTES, new_ticket
from kvstore.server.auth import UNIX_PEER_PREFIX, Caller
from kvstore.server.sessions import Session

POOL_MAX_BYTES = 256 << 20  # idle Put buffers kept for reuse


class BufferPool:
    """Put buffers kept for the next Put of the same size. Receiving into a fresh 32 MiB
    buffer page-faults on every page: 0.9 GB/s against 2.5 GB/s into a reused one over a Unix
    socket (2-core CPU box, 2026-12-01). Only a buffer nothing can still read or write comes
    back (see ``Transfers.discard``)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self.num_bytes = 0

    def take(self, num_bytes: int) -> torch.Tensor:
        free = self._free.get(num_bytes)
        if free:
            self.num_bytes -= num_bytes
            return free.pop()
        return torch.empty(num_bytes, dtype=torch.uint8)  # never zero-filled: all overwritten

    def give(self, buffer: torch.Tensor) -> None:
        num_bytes = buffer.numel()
        if self.num_bytes + num_bytes > self._max_bytes:
            self._free.clear()  # sizes changed: keep the newest
            self.num_bytes = 0
        if num_bytes <= self._max_bytes:
            self._free.setdefault(num_bytes, []).append(buffer)
            self.num_bytes += num_bytes


def transport_of(peer: str) -> str:
    """``unix`` for a Unix-socket peer, else the peer's host (``ipv4:1.2.3.4:5`` -> ``1.2.3.4``):
    a ticket asked for over one transport must be presented over the same one."""
    if peer.startswith(UNIX_PEER_PREFIX):
        return "unix"
    host = unquote(peer.split(":", 1)[-1]).rsplit(":", 1)[0].strip("[]")
    return host.removeprefix("::ffff:")  # an IPv4 client of a dual-stack listener


def peer_of(transport: str) -> str:
    """The peer string a data connection over ``transport`` authenticates as (the inverse of
    :func:`transport_of`, as far as authentication looks)."""
    return UNIX_PEER_PREFIX if transport == "unix" else f"ipv4:{transport}:0"


class Transfer:
    """One ticket: who may present it, over what, the bytes it moves and how that ended."""

    __slots__ = ("_timer", "buffer", "caller", "claimed", "context", "deadline", "error",
                 "finished", "is_put", "pieces", "presented", "storage", "task", "ticket",
                 "total_bytes", "transport")

    def __init__(self, caller: Caller, transport: str, buffer: memoryview | None, is_put: bool,
                 deadline: float, context: object, storage: torch.Tensor | None = None,
                 pieces: Sequence[memoryview] = ()) -> None:
        self.ticket = new_ticket()
        self.caller, self.transport, self.is_put = caller, transport, is_put
        self.buffer: memoryview | None = buffer  # a Put's bytes
        self.pieces: Sequence[memoryview] | None = pieces  # a Get's bytes, in order
        self.storage = storage  # a Put's pooled buffer, which ``buffer`` views
        self.total_bytes = len(buffer) if buffer is not None else sum(map(len, pieces))
        self.context = context  # what the handler needs afterwards (a Put's namespace, tokens)
        self.deadline = deadline  # loop time by which the ticket must be presented
        self.presented = False  # a data connection took it (single use)
        self.claimed = False  # a gRPC handler waits on it and discards it when done
        self.error: KVStoreError | None = None
        self.finished = asyncio.Event()
        self.task: asyncio.Task | None = None  # the data connection moving its bytes
        self._timer: asyncio.TimerHandle | None = None

    def finish(self, error: KVStoreError | None) -> None:
        if not self.finished.is_set():
            self.error = error
            self.finished.set()
            if error is not None:  # a failed transfer gives its bytes back at once
                self.buffer = self.storage = self.pieces = None


class ChannelTicket:
    """The context of a ticket from OpenChannel: the session its calls are granted under."""

    __slots__ = ("session",)

    def __init__(self, session: Session | None) -> None:
        self.session = session


class Transfers:
    """The live data tickets of one daemon and the budget they share.

    Args:
        idle_s: how long a ticket waits to be presented (``server.stream_idle_timeout_s``),
            and how long a moving one may go without progress before it is looked at again.
        max_transfers: the most tickets alive at once (``server.max_data_transfers``).
        max_pending_bytes: the most bytes all live tickets may hold together.
    """

    def __init__(self, idle_s: float, max_transfers: int, max_pending_bytes: int) -> None:
        self._idle_s = idle_s
        self._max_transfers = max_transfers
        self._max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._transfers: dict[bytes, Transfer] = {}
        self._held: dict[str | None, list[int]] = {}  # tenant -> [tickets, bytes] it holds
        self._pool = BufferPool(min(POOL_MAX_BYTES, max_pending_bytes))

    @property
    def num_transfers(self) -> int:
        return len(self._transfers)

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    @property
    def pooled_bytes(self) -> int:
        """Idle Put buffers kept for reuse."""
        return self._pool.num_bytes

    def present(self, ticket: bytes) -> Transfer | None:
        """Spend ``ticket``: the live transfer it names, from now on presented; None if it
        names none, or was presented before."""
        transfer = self._transfers.get(ticket) if len(ticket) == TICKET_BYTES else None
        if transfer is None or transfer.presented:
            return None
        transfer.presented = True  # single use, whoever presented it
        return transfer

    def open_channel(self, caller: Caller, peer: str, session: Session | None) -> Transfer:
        """A ticket that opens a call channel for ``caller`` over ``peer``'s transport, its
        calls granted under ``session`` (the data socket checked the channels' own bounds)."""
        self._check_room(caller, 0)
        return self._add(Transfer(caller, transport_of(peer), None, False, self._deadline(),
                                  ChannelTicket(session)))

    def open_put(self, caller: Caller, peer: str, total_bytes: int, context: object) -> Transfer:
        """A ticket for a Put of ``total_bytes``, its buffer set aside (not zero-filled)."""
        self._check_room(caller, total_bytes)
        buffer = self._pool.take(total_bytes)
        return self._add(Transfer(caller, transport_of(peer), memoryview(buffer.numpy()), True,
                                  self._deadline(), context, buffer))

    def open_get(self, caller: Caller, peer: str, pieces: Sequence[memoryview]
                 ) -> Transfer | None:
        """A ticket for sending ``pieces`` one after another (a tensor's bytes, or pages in
        place, in the tensor's order), claimed by the calling handler; None when the tickets
        or their budget are spent (the handler then streams chunks instead). The pieces must
        stay valid until the handler discards the transfer."""
        try:
            self._check_room(caller, sum(map(len, pieces)))
        except CapacityError:
            return None
        transfer = self._add(Transfer(caller, transport_of(peer), None, False,
                                      self._deadline(), None, pieces=pieces))
        transfer.claimed = True
        return transfer

    def claim_put(self, ticket: bytes, caller: Caller) -> Transfer:
        """The Put transfer ``ticket`` names, now owned by the calling handler."""
        transfer = self._transfers.get(ticket)
        if transfer is None or not transfer.is_put or transfer.claimed:
            raise LeaseNotFound("no open Put under this data ticket (never issued, already "
                                "completed, or expired)")
        if transfer.caller != caller:
            raise PermissionDenied("this data ticket was issued to another caller")
        transfer.claimed = True
        return transfer

    async def wait(self, transfer: Transfer) -> memoryview | None:
        """Once the transfer's bytes have moved: a Put's buffer (None for a Get); its error if
        they did not."""
        await transfer.finished.wait()
        if transfer.error is not None:
            raise transfer.error
        return transfer.buffer

    def discard(self, transfer: Transfer, reuse: bool = False) -> None:
        """Forget a transfer and give back its budget (a handler's last word on it).

        Args:
            reuse: nothing reads the Put's buffer any more (the store's put returned; a
                cancelled one may still be encoding from it in a thread): pool it. Only a
                transfer its connection finished can be reused; nothing writes into it then.
        """
        if reuse and transfer.storage is not None and transfer.finished.is_set() \
                and transfer.error is None:
            self._pool.give(transfer.storage)
        transfer.storage = None
        if self._transfers.pop(transfer.ticket, None) is transfer:
            self._pending_bytes -= transfer.total_bytes
            held = self._held[transfer.caller.tenant]
            held[0] -= 1
            held[1] -= transfer.total_bytes
            if not held[0]:
                del self._held[transfer.caller.tenant]
            if transfer._timer is not None:
                transfer._timer.cancel()
        transfer.presented = True  # a connection arriving now finds nothing to take
        transfer.finish(Unavailable("the transfer was abandoned"))
        transfer.buffer = transfer.pieces = None
        if transfer.task is not None and transfer.task is not asyncio.current_task():
            transfer.task.cancel()  # its caller has gone: stop moving bytes for nobody

    def _check_room(self, caller: Caller, total_bytes: int) -> None:
        """CapacityError unless a transfer of ``total_bytes`` for ``caller`` fits: within the
        tickets and bytes of all transfers, and within its tenant's fair share of them.

        A tenant may take another while it holds fewer tickets, and fewer bytes, than are
        left free: one tenant alone can hold at most about half of them, each tenant after it
        half of what is left, so a tenant that holds none always finds some free while
        another hogs them (like ``sessions.py`` bounds each tenant's sessions).
        """
        free = self._max_transfers - len(self._transfers)
        if free <= 0:
            raise CapacityError(f"{len(self._transfers)} data transfers are open, the most "
                                f"this daemon allows (server.max_data_transfers)")
        free_bytes = self._max_pending_bytes - self._pending_bytes
        if total_bytes > free_bytes:
            raise CapacityError(f"data transfers hold {self._pending_bytes} bytes; "
                                f"{total_bytes} more would pass the "
                                f"{self._max_pending_bytes}-byte budget")
        count, nbytes = self._held.get(caller.tenant, (0, 0))
        if count >= free or (count and nbytes >= free_bytes):
            raise CapacityError(f"tenant {shown(caller.tenant)} holds {count} data transfers "
                                f"({nbytes} bytes), its share while {free} "
                                f"({free_bytes} bytes) are left for others; stream this one")

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self._idle_s

    def _add(self, transfer: Transfer) -> Transfer:
        self._transfers[transfer.ticket] = transfer
        self._pending_bytes += transfer.total_bytes
        held = self._held.setdefault(transfer.caller.tenant, [0, 0])
        held[0] += 1
        held[1] += transfer.total_bytes
        transfer._timer = asyncio.get_running_loop().call_at(transfer.deadline, self._expire,
                                                             transfer)
        return transfer

    def _expire(self, transfer: Transfer) -> None:
        if transfer.presented and not transfer.finished.is_set():
            # moving: the connection's own idle bound ends it; look again after that
            transfer._timer = asyncio.get_running_loop().call_later(self._idle_s, self._expire,
                                                                    transfer)
            return
        transfer.finish(DeadlineExceeded(f"the data ticket was not presented within "
                                         f"{self._idle_s:g} s (server.stream_idle_timeout_s)"))
        if not transfer.claimed:  # no handler will discard it: do it now
            self.discard(transfer)

    def discard_all(self) -> None:
        """Forget every transfer (the daemon is closing)."""
        for transfer in list(self._transfers.values()):
            self.discard(transfer)
