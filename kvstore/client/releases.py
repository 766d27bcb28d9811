"""Late Releases: a lease's Release sent after the call that read it returned, carried by the
client's next Acquire or Reserve where one comes within ``RELEASE_LINGER_S``, else alone.

One mechanism, two drivers: ``CarriedReleases`` holds what waits and the carrying rules both
clients keep; ``LateReleases`` drives it for the blocking client (a worker thread sends what no
call carried), ``AsyncLateReleases`` for the asyncio client (a task per Release, which its
``aclose`` waits for). Both offer the same verbs: ``send`` a lease's Release, ``take`` the ids a
call carries and hand them back with ``carried``, ``flush`` what waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from kvstore.api import MAX_CARRIED_RELEASES
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.client")

# How long a late Release waits for the client's next Acquire to carry it before it goes alone:
# gets back to back (a prompt's chunks, a batch's prompts) come well within it, and an engine's
# scheduler steps, tens of milliseconds apart, mostly do.
RELEASE_LINGER_S = 0.05


class CarriedReleases:
    """The Releases a client holds back for its next Acquire or Reserve to carry (their
    ``release`` field), and the rules both clients keep: a call carries at most
    ``MAX_CARRIED_RELEASES``; what the daemon did not release goes in Releases of their own;
    a daemon that released none of those it was given does not read the field, and carrying
    stops. Not locked: ``LateReleases`` keeps it under its lock, ``AsyncLateReleases`` on its
    loop."""

    def __init__(self) -> None:
        self.waiting: dict[str, float] = {}  # lease id -> when its Release goes alone
        self.can_carry = True

    def take(self) -> list[str]:
        """Lease ids for a call to carry, no longer waiting (hand them to ``left_over``)."""
        if not self.can_carry or not self.waiting:
            return []
        taken = list(itertools.islice(self.waiting, MAX_CARRIED_RELEASES))
        for lease_id in taken:
            del self.waiting[lease_id]
        return taken

    def left_over(self, lease_ids: list[str], num_released: int | None) -> list[str]:
        """Of ``lease_ids``, carried by a call that ended releasing ``num_released`` of them
        (None: the call failed, so whether it did is unknown), those to release alone now
        (one already gone is answered LeaseNotFound, which the clients ignore)."""
        if not lease_ids or num_released == len(lease_ids):
            return []
        if num_released == 0:
            self.can_carry = False
        return list(lease_ids)


class LateReleases:
    """Releases of leases whose reads ended, after the call that read them returned.

    A get's caller has its data once the copy out of the arena ends; the Release round trip
    need not be on its path. A Release first waits up to ``LINGER_S`` for this client's next
    Acquire to carry it (``take``: no round trip of its own); what no Acquire took by then a
    worker thread sends. A lease still held meanwhile is bounded by its deadline (the reader
    checks it did not pass, ``check_in_time``) and, should this process die, by its session.
    At most ``MAX_PENDING`` wait: a caller reading faster than they are released waits for
    room, so late releases never pile up toward the tenant's lease quota.
    """

    MAX_PENDING = 8
    LINGER_S = RELEASE_LINGER_S

    def __init__(self, release: Callable[[str], None]) -> None:
        self._release = release
        self._cond = threading.Condition()
        self._carry = CarriedReleases()
        self._waiting = self._carry.waiting  # lease id -> when its Release goes alone
        self._in_flight = 0  # taken (by the worker or an Acquire), not answered yet
        self._urgent = 0  # callers of flush: send what waits now
        self._thread: threading.Thread | None = None
        self._stopping = False

    def send(self, lease_id: str) -> None:
        """Queue ``lease_id``'s Release (the worker starts at the first)."""
        with self._cond:
            self._ensure_worker()
            while len(self._waiting) + self._in_flight >= self.MAX_PENDING:
                self._cond.wait()
            self._waiting[lease_id] = time.monotonic() + self.LINGER_S
            self._cond.notify_all()

    def take(self) -> list[str]:
        """The waiting lease ids, for an Acquire to release first; hand them back with
        ``carried``."""
        with self._cond:
            taken = self._carry.take()
            self._in_flight += len(taken)
            return taken

    def carried(self, lease_ids: list[str], num_released: int | None) -> None:
        """The Acquire that took ``lease_ids`` ended: the daemon released ``num_released``
        of them (None: the call failed, so whether it did is unknown). What it did not
        release goes in Releases of their own now (``CarriedReleases.left_over``)."""
        if not lease_ids:
            return
        with self._cond:
            self._in_flight -= len(lease_ids)
            left = self._carry.left_over(lease_ids, num_released)
            if left:
                self._waiting.update(dict.fromkeys(left, 0.0))
                self._ensure_worker()  # even after close: these must still be sent
            self._cond.notify_all()

    def _ensure_worker(self) -> None:
        """Start the worker if none runs (the first Release, or one handed back after
        ``close``); the caller holds the condition's lock."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="kvstore-release")
            self._thread.start()

    @property
    def can_carry(self) -> bool:
        """False once the daemon showed it does not read carried ids."""
        return self._carry.can_carry

    @property
    def is_pending(self) -> bool:
        """Whether a queued Release is not answered yet."""
        with self._cond:
            return bool(self._waiting) or self._in_flight > 0

    def flush(self) -> None:
        """Wait until every queued Release was answered (sending those that wait now)."""
        with self._cond:
            self._urgent += 1
            self._cond.notify_all()
            try:
                while self._waiting or self._in_flight:
                    self._cond.wait()
            finally:
                self._urgent -= 1

    def close(self) -> None:
        """Send what is queued, then stop the worker."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._stopping = True
            self._cond.notify_all()
        if thread is not None:
            thread.join()

    def _next(self) -> str | None:
        """The next lease id the worker releases, once it is due; None: stop."""
        with self._cond:
            while True:
                if self._waiting:
                    lease_id = min(self._waiting, key=self._waiting.__getitem__)
                    wait_s = self._waiting[lease_id] - time.monotonic()
                    if wait_s <= 0 or self._urgent or self._stopping:
                        del self._waiting[lease_id]
                        self._in_flight += 1
                        return lease_id
                    self._cond.wait(wait_s)
                elif self._stopping and not self._in_flight:
                    return None
                else:
                    self._cond.wait()

    def _run(self) -> None:
        while (lease_id := self._next()) is not None:
            try:
                self._release(lease_id)
            except KVStoreError as exc:  # expired, or the daemon went: nothing is held then
                log.debug("late release of lease %s: %s", lease_id, exc)
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()


class AsyncLateReleases:
    """The asyncio driver of ``CarriedReleases`` (see ``LateReleases``): each Release waits in
    a task of its own, once the read it follows stopped (a cancelled caller does not stop the
    thread reading the pages), up to ``RELEASE_LINGER_S`` for an Acquire to carry it, then goes
    alone. The tasks, and other work the client sends after a call returned (``later``), are
    what ``flush`` and the client's ``aclose`` wait for."""

    def __init__(self, release: Callable[[str], Awaitable[None]]) -> None:
        self._release = release
        self._carry = CarriedReleases()  # its waiting ids' Releases are timed by tasks
        self._tasks: set[asyncio.Future[None]] = set()
        self._flushing = asyncio.Event()  # flush wants what waits sent now

    def later(self, work: Awaitable[None]) -> asyncio.Future[None]:
        """Run ``work`` as a task ``flush`` waits for."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def send(self, lease_id: str, read: asyncio.Future | None = None) -> None:
        """Release ``lease_id`` once ``read`` (the copy out of its pages) ended."""
        queued = self._carry.can_carry and (read is None or read.done())
        if queued:  # at once: the caller's next Acquire may come before the task runs
            self._carry.waiting[lease_id] = 0.0
        self.later(self._release_after(lease_id, read, queued))

    async def _release_after(self, lease_id: str, read: asyncio.Future | None,
                             queued: bool) -> None:
        """Once the read ended: up to ``RELEASE_LINGER_S`` for an Acquire to carry the
        Release (``queued``: waiting for one already), then the Release alone."""
        if read is not None:
            with contextlib.suppress(Exception):  # the read's error already reached the caller
                await read
        if not queued and self._carry.can_carry:
            self._carry.waiting[lease_id] = 0.0
            queued = True
        if queued:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RELEASE_LINGER_S):
                    await self._flushing.wait()
            if self._carry.waiting.pop(lease_id, None) is None:
                return  # an Acquire took it
        await self._release_quietly(lease_id)

    async def _release_quietly(self, lease_id: str) -> None:
        with contextlib.suppress(KVStoreError):  # expired, or the daemon went: nothing held
            await self._release(lease_id)

    def take(self) -> list[str]:
        """See ``LateReleases.take``."""
        return self._carry.take()

    def carried(self, lease_ids: list[str], num_released: int | None) -> None:
        """See ``LateReleases.carried``: what the Acquire did not release goes alone."""
        for lease_id in self._carry.left_over(lease_ids, num_released):
            self.later(self._release_quietly(lease_id))

    @property
    def can_carry(self) -> bool:
        return self._carry.can_carry

    @property
    def is_waiting(self) -> bool:
        """Whether a Release waits for a call to carry it."""
        return bool(self._carry.waiting)

    @property
    def is_pending(self) -> bool:
        """Whether a Release (or other ``later`` work) has not ended yet."""
        return bool(self._tasks)

    async def flush(self) -> None:
        """Send what waits now, and wait until every task ended."""
        if self._tasks:
            self._flushing.set()
            try:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            finally:
                self._flushing.clear()
