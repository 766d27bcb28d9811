"""Zero-copy writers in the DRAM tier: staging slots lent to them, and the checked copy of their
pages into published memory (``claim``, ``checked``, then the tier's ``publish`` or ``drop``).

A staging slot is handed out, a client of the tenant writes an encoded page into its mapped
arena, then the page is copied into a published slot in a thread and checked there, where the
writer cannot reach it: one copy, checked after it landed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvstore.api import TierStats
from kvstore.errors import CorruptPage, InvalidArgument, shown
from kvstore.keys import BlockKey
from kvstore.page import PageMeta
from kvstore.tiers.base import PageCheck
from kvstore.tiers.dram.arena import Step
from kvstore.tiers.dram.growth import Growth, TenantMemory
from kvstore.tiers.dram.slabs import Slot

# Threads that copy a commit's pages into published memory and check them there: one per core
# (up to 4: the copies share the memory bus).
CHECK_THREADS = min(4, os.cpu_count() or 1)
# A commit's copy goes to its check (hash, NaN/Inf) in pieces of about this size, each right
# after it landed: a 2 MiB block's page whole. Smaller pieces cost more than the caches save once
# check threads and the loop share the GIL (each piece takes it back again): 256 KiB pieces made
# a 2 MiB page's job 1.23 against 0.59 ms on the 2-core box, and 32 MiB puts 16-18 against 11 ms
# on the 16-core H200 host (2026-12-02). Pieces matter for pages larger than a core's caches.
CHECK_PIECE_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class ArenaSlot:
    """A slot in one tenant's staging arena: the ``Slot`` this tier lends."""

    arena: TenantMemory
    slot: Slot

    @property
    def offset(self) -> int:
        return self.slot.offset

    @property
    def slot_bytes(self) -> int:
        return self.slot.slot_bytes


@dataclass(slots=True, eq=False)
class PublishClaim:
    """A published slot taken for a staging slot's page (``DramTier.claim``): the copy and its
    check run in a thread; ``done`` is their outcome, the page's meta."""

    slot: ArenaSlot  # the writer's staging slot
    key: BlockKey
    nbytes: int
    step: Step
    published: Slot
    done: asyncio.Future[PageMeta]


def _copy_and_check(dst: memoryview, src: memoryview, check: PageCheck) -> PageMeta:
    """Copy a staging page into its published slot in pieces of ``CHECK_PIECE_BYTES``, each
    fed to ``check`` (a read-only view of the copy) right after it landed, on one thread, so
    the check reads each piece while it is still in the caches; then ``check.finish``."""
    copy = dst.toreadonly()
    num_bytes = src.nbytes
    # Pieces of about equal size: a 2 MiB block's page (2 MiB and its header) is one piece,
    # not a whole one and a 4 KiB tail.
    num_pieces = max(1, round(num_bytes / CHECK_PIECE_BYTES))
    start = 0
    for i in range(1, num_pieces + 1):
        end = num_bytes * i // num_pieces
        # numpy's copy, one core's, whatever PARALLEL_COPY says: several check threads copy at
        # once, and torch's copy from each would start an OpenMP team of every core. On the
        # 16-core H200 host (2026-12-04, 4 check threads, five pairs, bench/put_paths.py's
        # notes in BENCHMARKS.md) a 32 MiB commit took 6.2-7.0 ms with numpy's copy against
        # 6.8-7.5 ms with torch's, numpy's the quicker in four pairs.
        np.copyto(np.frombuffer(dst[start:end], dtype=np.uint8),
                  np.frombuffer(src[start:end], dtype=np.uint8))
        check.feed(copy, end)
        start = end
    return check.finish(dst)


def _settle(loop: asyncio.AbstractEventLoop, claim: PublishClaim,
            job: concurrent.futures.Future[PageMeta]) -> None:
    # Resolved on the loop, and only once the thread is done with both slots.
    loop.call_soon_threadsafe(_resolve, claim.done, job)


def _resolve(done: asyncio.Future[PageMeta], job: concurrent.futures.Future[PageMeta]) -> None:
    if done.done():
        return
    exc = job.exception()
    if exc is None:
        done.set_result(job.result())
    else:
        done.set_exception(exc)


class Staging:
    """Lends staging slots and runs claims: the copy of a staging page into a published slot
    and its check there, on ``CHECK_THREADS`` threads. Counts refusals in the tier's ``stats``.
    Called from the tier's event loop only."""

    def __init__(self, growth: Growth, stats: TierStats) -> None:
        self._growth = growth
        self._stats = stats
        # Commits copy and check their pages side by side (a decode may take milliseconds).
        self._checker = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="kvstore-dram-check")

    def close(self) -> None:
        self._checker.shutdown(wait=False)

    async def allocate_slot(self, nbytes: int, arena: TenantMemory) -> ArenaSlot | None:
        """A free staging slot of at least ``nbytes`` in ``arena``; None when there is no
        room."""
        slot = await self._growth.staging_slot(arena, nbytes)
        if slot is None:
            self._stats.rejected += 1
            return None
        return ArenaSlot(arena, slot)

    @staticmethod
    def slot_view(slot: ArenaSlot) -> memoryview:
        """The whole staging slot in its arena (writable, by its writer too)."""
        return slot.arena.memory.view[slot.offset : slot.offset + slot.slot_bytes]

    async def claim(self, slot: ArenaSlot, key: BlockKey, nbytes: int,
                    check: PageCheck) -> PublishClaim | None:
        """``DramTier.claim``: a published slot for the page in ``slot``, its copy and check
        started in a thread; None (counted ``rejected``) when published memory has no room."""
        arena = slot.arena
        if not 0 < nbytes <= slot.slot_bytes:
            raise CorruptPage(f"page for key {bytes(key).hex()} says it is {nbytes} bytes; its "
                              f"slot holds {slot.slot_bytes}")
        found = await self._growth.published_slot(arena, nbytes)
        if found is None:
            self._stats.rejected += 1
            return None
        step, published = found
        dst = step.memory.view[published.offset : published.offset + nbytes]
        src = self.slot_view(slot)[:nbytes]
        claim = PublishClaim(slot, key, nbytes, step, published,
                             asyncio.get_running_loop().create_future())
        job = self._checker.submit(_copy_and_check, dst, src, check)
        job.add_done_callback(functools.partial(_settle, asyncio.get_running_loop(), claim))
        return claim

    @staticmethod
    async def checked(claim: PublishClaim) -> PageMeta:
        """Wait for ``claim``'s copy and check: the page's meta, or what the check raised
        (InvalidArgument when its meta names another key or tenant)."""
        meta = await asyncio.shield(claim.done)
        if meta.key != claim.key or meta.tenant != claim.slot.arena.tenant:
            raise InvalidArgument(f"page for key {bytes(claim.key).hex()} does not fit this "
                                  f"slot of tenant {shown(claim.slot.arena.tenant)}'s arena")
        return meta

    def drop(self, claim: PublishClaim) -> None:
        """Give ``claim``'s published slot back once its copy is done (a thread still writing
        it must not write into a slot lent again); the staging slot stays the caller's."""
        if claim.done.done():
            self.release_claim(claim)
        else:
            claim.done.add_done_callback(lambda _: self.release_claim(claim))

    @staticmethod
    def release_claim(claim: PublishClaim) -> None:
        """Give ``claim``'s published slot back (its step may be gone already)."""
        arena = claim.slot.arena
        if claim.step.region in arena.steps.steps:
            arena.steps.release(claim.step, claim.published)

    @staticmethod
    def abort(slot: ArenaSlot) -> None:
        """Give back a staging slot that was never published."""
        slot.arena.alloc.release(slot.slot)
