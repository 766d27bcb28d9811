"""The DRAM tier: encoded pages in fixed slots of shared memory, each tenant's memory of its own.

A tenant's memory comes in two kinds, both memfds with no path anyone could open, whose
descriptors the daemon hands only to that tenant's clients (``region_fd``, served by
``kvstore.server.fdpass``), so a client maps its own tenant's memory and nobody else's:

- published memory holds every stored page: one memfd per growth step (``SealedStep``), each
  its own region, mapped writable by the daemon and then sealed against every other writer
  (``F_SEAL_FUTURE_WRITE``). The daemon enters a page there only once it is verified (a plain
  write copies a page the store built or verified; a commit copies a writer's slot there and
  the store checks that copy before it is entered), and nobody can change it afterwards, so
  reads serve it in place, trusted
  (``Page.is_trusted``): no private copy, no second hash. Clients map it read-only; no other
  mapping is possible.
- staging memory is today's writable arena (one memfd per tenant, ``ShmArena`` carved by a
  ``SlabAllocator``): slots lent to zero-copy writers (reservations) and nothing else. No page
  is ever served from it.

All of it grows within the tier's capacity (a shared ``GrowthBudget``). A sealed step cannot
give part of its memory back (the seal refuses MADV_REMOVE and hole punching): it goes back
whole once none of its slots holds a page, when another tenant's memory needs to grow (or the
tier closes); its header then says it is retired, so clients drop their mappings of it.

Making room is the store's job: the tier never evicts on its own. Slots come in size classes:
when memory is full, deleting a page frees room for a page of the same class in its tenant's
published memory, one slot for one slot, so ``room_for(n)`` asks for one slot of the class of
``n`` and ``footprint(key)`` reports each page's class. Memory moves between tenants as whole
steps. ``room_for_tenant(n, tenant)`` says whose blocks make room for a page of ``tenant``: its
own (one slot of the class) while its memory is at least as large as every other tenant's, else
every block of the emptiest step of the largest other one (``RoomNeed.keys``), so one tenant
filling the tier cannot starve another, and tenants tend to equal sizes among those that store.
``room_for_slot(n, tenant)`` answers the same for a staging slot: free staging memory, or the
blocks of a whole step, which then goes back to the budget for staging to grow into.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.api import Medium
from kvstore.config import DramConfig
from kvstore.errors import CapacityError, CorruptPage, InvalidArgument, Unavailable, shown
from kvstore.keys import BlockKey
from kvstore.page import (
    PUBLISHED_HEADER_BYTES,
    Page,
    PageMeta,
    PendingPage,
    parse_page,
    trusted_payload,
)
from kvstore.room import Footprint, RoomNeed
from kvstore.tiers.base import PageCheck, SlotTier, TierStats
from kvstore.tiers.dram.arena import SealedStep, ShmArena, Step, StepPool
from kvstore.tiers.dram.lingering import MAX_FETCHERS, LingeringSteps, holders
from kvstore.tiers.dram.slabs import GrowthBudget, SlabAllocator, Slot, round_down, round_up

log = logging.getLogger(__name__)

# A write copies the page into its slot (~20 GB/s inline): from 256 KiB up (over ~13 us of
# copying, against a ~100 us thread hop only worth paying for the loop's sake) it runs in the
# tier's copy thread, with a copy that releases the GIL (a memoryview assignment holds it).
THREAD_COPY_BYTES = 256 << 10

MANY_CORES = (os.cpu_count() or 1) >= 4
# Threads that copy a commit's pages into published memory and check them there: one per core
# (up to 4: the copies share the memory bus).
CHECK_THREADS = min(4, os.cpu_count() or 1)
# A commit's copy goes to its check (hash, NaN/Inf) in pieces of about this size, each right
# after it landed: a 2 MiB block's page whole. Smaller pieces cost more than the caches save once
# check threads and the loop share the GIL (each piece takes it back again): 256 KiB pieces made
# a 2 MiB page's job 1.23 against 0.59 ms on the 2-core box, and 32 MiB puts 16-18 against 11 ms
# on the 16-core H200 host (2026-12-02). Pieces matter for pages larger than a core's caches.
CHECK_PIECE_BYTES = 2 << 20
# Which copy the thread runs (2 MiB pages into the arena, measured 2026-11-29): on the 2-core box
# numpy.copyto 9.2 GB/s, torch copy_ 8.2 (median); on a 16-core H200 host numpy.copyto 5.3 GB/s,
# torch copy_ 52 (it spreads the copy over cores). One copy thread, so copies never stack up
# several OpenMP teams on the same cores.
PARALLEL_COPY = MANY_CORES and torch.get_num_threads() >= 4

# Growth ahead of demand (the next step, made while nothing waits for it) runs on a thread of its
# own, this much nicer (Linux keeps a nice value per thread): faulting in a step takes a core for
# milliseconds, and the calls the loop answers meanwhile must not wait for it on a small host. On
# the 2-core box (2026-12-02) a Lookup right after a 64 MiB put took 0.93 ms on average, 3.46 at
# worst, while the tier grew, against 0.57 and 0.62 once it had grown.
AHEAD_NICE = 10

# A published step given back while client processes map it stays charged until they let go
# (``kvstore.tiers.dram.lingering``). Told at once (a Hold event), a client reading its session's
# stream drops it as the event arrives: the write that needed the memory waits up to this long
# for that. Later writes look again at most every LINGER_CHECK_S (a look reads
# /proc/<pid>/maps and /proc/<pid>/fd of the step's clients).
LINGER_WAIT_S = 0.25
LINGER_POLL_S = 0.01
LINGER_CHECK_S = 1.0

# Every arena maps the tier's whole capacity of address space up front (so views never move);
# 1024 arenas of 64 GiB take half of the 128 TiB a process can map.
MAX_ARENAS = 1024

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and addressable
# from kernels through unified addressing.
_CUDA_HOST_REGISTER_FLAGS = 1 | 2
# Page bytes are only ever read as a copy source; torch warns about any read-only buffer.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass(slots=True, eq=False)
class _Arena:
    """One tenant's memory: its staging arena (the memfd, the allocator that carves it and the
    region name clients ask for) and its published steps."""

    tenant: str
    region: str  # the staging arena's
    memory: ShmArena
    alloc: SlabAllocator
    steps: StepPool
    pinned: list[int] = field(default_factory=list)  # registered staging addresses
    keys_by_step: dict[str, set[BlockKey]] = field(default_factory=dict)  # region -> keys

    @property
    def backed_bytes(self) -> int:
        return self.alloc.backed_bytes + self.steps.backed_bytes

    @property
    def releasable_bytes(self) -> int:
        return self.alloc.releasable_bytes + self.steps.releasable_bytes


@dataclass(frozen=True, slots=True)
class ArenaSlot:
    """A slot in one tenant's staging arena: the ``Slot`` this tier lends."""

    arena: _Arena
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


def _lower_priority() -> None:
    """Make the calling thread ``AHEAD_NICE`` nicer (only it: Linux keeps nice per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + AHEAD_NICE))


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


@dataclass(slots=True)
class _Entry:
    step: Step
    slot: Slot
    length: int  # page bytes (the slot may be longer)
    meta: PageMeta

    def view(self) -> memoryview:
        return self.step.memory.view[self.slot.offset : self.slot.offset + self.length]


def _copy_large(dst: memoryview, src: memoryview) -> None:
    if PARALLEL_COPY:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _copy(dst: memoryview, src: memoryview) -> None:
    if src.nbytes < THREAD_COPY_BYTES:  # on the loop: a memoryview assignment is quickest
        dst[:] = src
    else:
        _copy_large(dst, src)


class DramTier(SlotTier):
    """Pages in sealed published steps, one set per tenant, and staging arenas for zero-copy
    writers; reads are trusted views into published memory.

    Memory grows in ``chunk_bytes`` steps, in a thread, one step ahead of demand, so the
    request path rarely waits on page faults. ``region_of(tenant)`` (staging), ``locate(key)``
    (a page's step and place) and ``region_fd(region)`` let a client of that tenant map its
    memory and read a page in place.
    """

    name = "dram"

    def __init__(self, config: DramConfig, name: str = "dram") -> None:
        self.name = name
        self.config = config
        self._budget = GrowthBudget(config.capacity_bytes)
        self._arenas: dict[str, _Arena] = {}  # by tenant
        self._regions: dict[str, tuple[_Arena, ShmArena | SealedStep]] = {}  # by region name
        self._entries: dict[BlockKey, _Entry] = {}
        self._pending: dict[BlockKey, asyncio.Future[bool]] = {}
        self._grow_lock = asyncio.Lock()  # one for all memory: it grows within one budget
        self._grow_task: asyncio.Task[None] | None = None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvstore-dram-copy")
        # Commits copy and check their pages side by side (a decode may take milliseconds).
        self._checker = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="kvstore-dram-check")
        self._grower = ThreadPoolExecutor(1, thread_name_prefix="kvstore-dram-grow",
                                          initializer=_lower_priority)
        self._pin_cuda = False
        self._is_open = False
        self._retired_listeners: list[Callable[[str], None]] = []
        self._lingering = LingeringSteps()
        self._lingering_checked = 0.0  # time.monotonic() of the last look
        self._stats = TierStats(name=self.name)

    @property
    def medium(self) -> Medium:
        return Medium.HOST

    @property
    def max_page_bytes(self) -> int:
        return max(0, self._budget.capacity_bytes - PUBLISHED_HEADER_BYTES)

    @property
    def capacity_bytes(self) -> int:
        return self._budget.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Slot bytes in use: pages in published memory and staging slots lent to writers."""
        return sum(a.steps.used_bytes + a.alloc.used_bytes for a in self._arenas.values())

    def region_of(self, tenant: str) -> str:
        """The region name of ``tenant``'s staging arena (made now if the tenant has none)."""
        return self._arena(tenant).region

    def region_fd(self, region: str) -> tuple[str, int] | None:
        """``(tenant, memfd)`` of the staging arena or published step named ``region``, or
        None if there is none (or it was given back). The descriptor stays the tier's: send or
        duplicate it, never close it."""
        found = self._regions.get(region) if self._is_open else None
        return None if found is None else (found[0].tenant, found[1].fd)

    def sent_to(self, region: str, pid: int) -> None:
        """``FdRegions.sent_to``: a published step remembers the processes its descriptor
        went to, so that, given back, it stays charged while one of them holds it."""
        found = self._regions.get(region)
        step = None if found is None else found[0].steps.steps.get(region)
        if pid > 0 and step is not None and len(step.fetchers) < MAX_FETCHERS:
            step.fetchers.add(pid)

    def on_retired(self, listener: Callable[[str], None]) -> None:
        """``FdRegions.on_retired``: called with the tenant whose published steps went back."""
        self._retired_listeners.append(listener)

    def arena_path(self, tenant: str) -> str | None:
        """A path through which this process, and only it, can open ``tenant``'s staging arena
        (``/proc/self/fd/N``), or None if the tenant has none: for tests and tools."""
        arena = self._arenas.get(tenant)
        return None if arena is None else f"/proc/self/fd/{arena.memory.fd}"

    def published_regions(self, tenant: str) -> list[str]:
        """The regions of ``tenant``'s published memory (its steps), for tests and tools."""
        arena = self._arenas.get(tenant)
        return [] if arena is None else list(arena.steps.steps)

    def region_path(self, region: str) -> str | None:
        """The same for any region (a staging arena or a published step), or None."""
        found = self._regions.get(region)
        return None if found is None else f"/proc/self/fd/{found[1].fd}"

    async def open(self) -> None:
        """Get ready; arenas are made as tenants first store, no memory is grown yet."""
        if not hasattr(os, "memfd_create"):
            raise Unavailable("the dram tier needs memfd_create (Linux 3.17 or later)")
        self._is_open = True

    async def close(self) -> None:
        """Wait for growth in flight, unpin and close all memory. Pages are dropped."""
        if not self._is_open:
            return
        self._is_open = False
        if self._grow_task is not None:  # it takes the lock itself, then sees the tier closed
            await asyncio.gather(self._grow_task, return_exceptions=True)
        async with self._grow_lock:  # a write may still be growing
            self._entries.clear()
            for arena in self._arenas.values():
                self._unpin(arena)
                arena.memory.close()
                for step in arena.steps.take_all():
                    self._retire(step)
            self._arenas.clear()
            self._regions.clear()
            self._lingering.clear()
        self._copier.shutdown(wait=False)
        self._checker.shutdown(wait=False)
        self._grower.shutdown(wait=False)

    async def reserve(self, nbytes: int, tenant: str) -> int:
        """Grow ``tenant``'s published memory to ``nbytes`` (within the budget) ahead of demand,
        in empty steps cut for whichever class comes first.

        Grows one step at a time in a thread, so writes interleave and the loop stays free
        (prefaulting runs at about 0.4 GB/s). Returns the tenant's published bytes.
        """
        arena = self._arena(tenant)
        target = min(round_up(max(nbytes, 0)), self.capacity_bytes)
        while self._is_open and arena.steps.backed_bytes < target:
            async with self._grow_lock:
                step_bytes = round_down(min(arena.steps.chunk_bytes,
                                            target - arena.steps.backed_bytes,
                                            self._budget.room_bytes))
                if (not self._is_open or step_bytes <= PUBLISHED_HEADER_BYTES
                        or not await self._grow_step(arena, step_bytes)):
                    break
        return arena.steps.backed_bytes

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    def room_for(self, nbytes: int) -> RoomNeed | None:
        if self._is_open and self._fits(nbytes):
            return None
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        return RoomNeed(nbytes=slot_bytes, size_class=slot_bytes)

    def room_for_tenant(self, nbytes: int, tenant: str,
                        protected: Callable[[BlockKey], bool] | None = None
                        ) -> RoomNeed | None:
        """None if ``tenant``'s page of ``nbytes`` fits now in its published memory (in a free
        slot, by growing a step, or by taking free memory back from anyone); else whose blocks
        to delete: one slot of the page's class from ``tenant``'s own blocks while its memory is
        at least as large as every other tenant's, else every block of the emptiest step of the
        largest other one (larger by more than one slot, so two tenants do not take a step back
        and forth). The step is one with no block ``protected`` where there is one."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        own_need = RoomNeed(nbytes=slot_bytes, size_class=slot_bytes, tenant=tenant)
        if not self._is_open or slot_bytes > self.max_page_bytes:
            return own_need
        arena = self._arenas.get(tenant)
        if self._fits_for(arena, nbytes):
            return None
        own_bytes = arena.backed_bytes if arena is not None else 0
        donor = max((a for a in self._arenas.values() if a is not arena and a.keys_by_step),
                    key=lambda a: a.backed_bytes, default=None)
        if donor is not None and donor.backed_bytes > own_bytes + slot_bytes:
            return self._step_need(donor, protected)
        # Its own blocks of other classes are not emptied for it: the page goes down the chain.
        return own_need

    def room_for_slot(self, nbytes: int, tenant: str,
                      protected: Callable[[BlockKey], bool] | None = None) -> RoomNeed | None:
        """None if a staging slot of ``nbytes`` for ``tenant`` can be had now (free staging
        memory, growth within the budget, free memory taken back); else every block of the
        emptiest step of the largest tenant's memory (its own too) that holds no block
        ``protected`` (where there is one): the step then goes back to the budget and staging
        grows into it."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        any_need = RoomNeed(nbytes=slot_bytes, tenant=tenant)
        if not self._is_open or slot_bytes > self.capacity_bytes:
            return any_need
        arena = self._arenas.get(tenant)
        if arena is not None and arena.alloc.growth_plan(nbytes) is not None:
            return None
        if self._spare_bytes(arena) >= slot_bytes:
            return None
        donor = max((a for a in self._arenas.values() if a.keys_by_step),
                    key=lambda a: a.backed_bytes, default=None)
        return any_need if donor is None else self._step_need(donor, protected)

    def footprint(self, key: BlockKey) -> Footprint | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        return Footprint(size_class=entry.slot.slot_bytes, nbytes=entry.slot.slot_bytes)

    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        """Copy ``page`` into a slot of its tenant's published memory; False (counted
        ``rejected``) when there is no room. The page is the store's (built by it, or verified
        when it was read from another tier): it is published as it is."""
        self._check_open()
        if key in self._entries:
            return True
        if key in self._pending:
            return await asyncio.shield(self._pending[key])
        view = memoryview(page).cast("B")
        try:
            parsed = parse_page(view, key)
            if meta.key != key or len(parsed.data) != view.nbytes:
                raise CorruptPage(f"its meta names key {bytes(meta.key).hex()}")
        except CorruptPage as exc:
            raise InvalidArgument(f"dram write of key {bytes(key).hex()}: not a whole page "
                                  f"of that key: {exc}") from None
        # Entered with the meta the page holds: reads hand that out without parsing it again.
        return await self._write_once(key, view.nbytes, parsed.meta,
                                      functools.partial(_copy, src=view))

    async def write_pending(self, key: BlockKey, page: PendingPage) -> bool:
        """Frame ``page`` straight into a slot of its tenant's published memory (one pass that
        copies and hashes the payload, no finished page copied in); False (counted
        ``rejected``) when there is no room. The page is the store's: published as written."""
        self._check_open()
        if key in self._entries:
            return True
        if key in self._pending:
            return await asyncio.shield(self._pending[key])
        if page.meta.key != key:
            raise InvalidArgument(f"dram write of key {bytes(key).hex()}: the page's meta names "
                                  f"key {bytes(page.meta.key).hex()}")
        return await self._write_once(key, page.nbytes, page.meta, page.write_into)

    async def _write_once(self, key: BlockKey, nbytes: int, meta: PageMeta,
                          fill: Callable[[memoryview], None]) -> bool:
        """Store a page that ``fill`` writes, once: writers of the same key meanwhile wait."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[key] = done
        try:
            stored = await self._store(key, nbytes, meta, fill) is not None
        finally:
            del self._pending[key]
            done.set_result(key in self._entries)
        return stored

    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """The page of ``key``, trusted, or None on a miss.

        The page is a view into published memory: the tier verified it when it put it there
        and nobody can write it since, so no read copies or hashes it (``verify`` changes
        nothing here; ``verify_page`` accepts the page at once). The view stays valid until the
        key is deleted. Only a header or meta that does not parse, which would be a fault of
        this process, is dropped and counted as ``corrupt``.
        """
        self._check_open()
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        try:
            # The meta is the one entered with the page (it parsed then): only the header is
            # read again, so a read parses no JSON (10 us of a 2 MiB get's 100-200).
            view = entry.view()
            page = Page(entry.meta, trusted_payload(view, key), view, is_trusted=True)
        except CorruptPage as exc:
            log.error("dram: dropping unreadable page %s in %s: %s", bytes(key).hex(),
                      entry.step.region, exc)
            self._remove(key)
            self._stats.corrupt += 1
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        self._stats.bytes_read += entry.length
        return page

    async def delete(self, key: BlockKey) -> bool:
        if key not in self._entries:
            return False
        self._remove(key)
        return True

    def entries(self) -> Iterator[PageMeta]:
        return iter([entry.meta for entry in self._entries.values()])

    def page_size(self, key: BlockKey) -> int | None:
        """Bytes of the stored page for ``key`` (not its slot), or None if absent."""
        entry = self._entries.get(key)
        return None if entry is None else entry.length

    def locate(self, key: BlockKey) -> tuple[str, int, int] | None:
        """``(region, offset, length)`` of the page of ``key``: the published step it is in
        and where, or None. Offsets are multiples of 4096, so a reader can mmap exactly the
        page."""
        entry = self._entries.get(key)
        return None if entry is None else (entry.step.region, entry.slot.offset, entry.length)

    # Zero-copy writers (the store's reservations): a staging slot is handed out, a client of
    # the tenant writes an encoded page into its mapped arena, then the tier copies it into
    # published memory (``claim``), the store checks that copy there, and the tier enters it
    # (``publish``): one copy, checked where the writer cannot reach it.

    async def allocate_slot(self, nbytes: int, tenant: str) -> ArenaSlot | None:
        """A free staging slot of at least ``nbytes`` in ``tenant``'s arena; None when there is
        no room."""
        self._check_open()
        arena = self._arena(tenant)
        slot = arena.alloc.allocate(nbytes) or await self._allocate_slow(arena, nbytes)
        if slot is None:
            self._stats.rejected += 1
            return None
        return ArenaSlot(arena, slot)

    def slot_view(self, slot: ArenaSlot) -> memoryview:
        """The whole staging slot in its arena (writable, by its writer too)."""
        return slot.arena.memory.view[slot.offset : slot.offset + slot.slot_bytes]

    async def claim(self, slot: ArenaSlot, key: BlockKey, nbytes: int,
                    check: PageCheck) -> PublishClaim | None:
        """Take a published slot for the ``nbytes``-byte page a writer put into staging
        ``slot``, and start copying the page there and running ``check`` on the copy, in a
        thread; None (counted ``rejected``) when published memory has no room (the store
        makes room first). ``checked``, then ``publish`` or ``drop``, finish it.

        The check runs on the published copy, which nobody but this tier can write, after the
        copy: a writer that changes its slot meanwhile (a forged page, checksum recomputed)
        changes at most what is checked, never what is checked into what is served. Until
        ``publish`` no reader is told where the copy is.
        """
        self._check_open()
        arena = slot.arena
        if not 0 < nbytes <= slot.slot_bytes:
            raise CorruptPage(f"page for key {bytes(key).hex()} says it is {nbytes} bytes; its "
                              f"slot holds {slot.slot_bytes}")
        found = arena.steps.allocate(nbytes) or await self._publish_slow(arena, nbytes)
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

    async def checked(self, claim: PublishClaim) -> PageMeta:
        """Wait for ``claim``'s copy and check: the page's meta, or what the check raised
        (InvalidArgument when its meta names another key or tenant)."""
        meta = await asyncio.shield(claim.done)
        if meta.key != claim.key or meta.tenant != claim.slot.arena.tenant:
            raise InvalidArgument(f"page for key {bytes(claim.key).hex()} does not fit this "
                                  f"slot of tenant {shown(claim.slot.arena.tenant)}'s arena")
        return meta

    def publish(self, claim: PublishClaim) -> int:
        """Enter ``claim``'s checked copy as its key (a copy stored meanwhile by another writer
        is kept instead) and free the staging slot; the page's length."""
        meta = claim.done.result()
        arena = claim.slot.arena
        self.abort(claim.slot)
        entry = self._entries.get(claim.key)
        if entry is not None or claim.step.region not in arena.steps.steps:
            self._release_claim(claim)
            return 0 if entry is None else entry.length
        self._entries[claim.key] = _Entry(claim.step, claim.published, claim.nbytes, meta)
        arena.keys_by_step.setdefault(claim.step.region, set()).add(claim.key)
        self._stats.bytes_written += claim.nbytes
        self._grow_ahead(arena, claim.nbytes)
        return claim.nbytes

    def drop(self, claim: PublishClaim) -> None:
        """Give ``claim``'s published slot back once its copy is done (a thread still writing
        it must not write into a slot lent again); the staging slot stays the caller's."""
        if claim.done.done():
            self._release_claim(claim)
        else:
            claim.done.add_done_callback(lambda _: self._release_claim(claim))

    def _release_claim(self, claim: PublishClaim) -> None:
        arena = claim.slot.arena
        if claim.step.region in arena.steps.steps:
            arena.steps.release(claim.step, claim.published)

    def abort(self, slot: ArenaSlot) -> None:
        """Give back a staging slot that was never published."""
        slot.arena.alloc.release(slot.slot)

    def stats(self) -> TierStats:
        s = self._stats
        arenas = list(self._arenas.values())
        return TierStats(
            name=self.name, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
            num_blocks=len(self._entries), hits=s.hits, misses=s.misses,
            corrupt=s.corrupt, rejected=s.rejected, bytes_read=s.bytes_read,
            bytes_written=s.bytes_written,
            extra={
                "arena_bytes": self._budget.grown_bytes,
                "arenas": len(arenas),
                "published_steps": sum(len(a.steps.steps) for a in arenas),
                "published_bytes": sum(a.steps.backed_bytes for a in arenas),
                "staging_bytes": sum(a.alloc.backed_bytes for a in arenas),
                "slot_classes": sum(a.steps.num_classes for a in arenas),
                "free_slots": sum(a.steps.num_free_slots for a in arenas),
                # given back, still mapped by client processes: charged until they let go
                "lingering_bytes": self._lingering.nbytes,
            },
        )

    async def pin_cuda(self) -> bool:
        """Register all memory as pinned host memory (cudaHostRegister), now and as it grows.

        Costs about 0.5 s per GiB registered (DESIGN.md), paid in a thread: now for what is
        already grown, later inside each growth step. Returns False, doing nothing, without
        CUDA.
        """
        self._check_open()
        if not torch.cuda.is_available():
            return False
        async with self._grow_lock:
            if not self._pin_cuda:
                for arena in self._arenas.values():
                    for offset, nbytes in arena.alloc.backed_ranges():  # holes hold no memory
                        address = arena.memory.base_address() + offset
                        await asyncio.to_thread(self._register, address, nbytes)
                        arena.pinned.append(address)
                    arena.alloc.merge_growth = False  # later growth: registrations of their own
                    for step in list(arena.steps.steps.values()):
                        await asyncio.to_thread(self._register, step.memory.base_address(),
                                                step.nbytes)
            self._pin_cuda = True
        return True

    # --- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._is_open:
            raise Unavailable("dram tier is not open (call open() first, or it was closed)")

    def _arena(self, tenant: str) -> _Arena:
        """``tenant``'s memory, made on first use (a sealed staging memfd; nothing grown)."""
        self._check_open()
        arena = self._arenas.get(tenant)
        if arena is not None:
            return arena
        if len(self._arenas) >= MAX_ARENAS:
            raise CapacityError(f"the {self.name} tier holds {MAX_ARENAS} tenant arenas, its "
                                f"limit; tenant {shown(tenant)} gets none")
        region = f"{self.name}.{secrets.token_hex(8)}"
        memory = ShmArena(f"kvstore-{region}", self.capacity_bytes)
        memory.create()
        alloc = SlabAllocator(self.capacity_bytes, self.config.chunk_bytes, self._budget)
        alloc.merge_growth = not self._pin_cuda
        arena = _Arena(tenant, region, memory, alloc, StepPool(self.config.chunk_bytes))
        self._arenas[tenant] = arena
        self._regions[region] = (arena, memory)
        log.info("dram: made arena %s for tenant %s", region, shown(tenant))
        return arena

    def _spare_bytes(self, arena: _Arena | None = None) -> int:
        """Memory the budget has left, with what tenants could give back, for ``arena`` to
        grow into (None: anyone): all of every other tenant's free memory, and its own empty
        steps but not its free staging memory. A tenant's staging memory stays its writers'
        while nobody else needs it: turning it into published memory and back with each
        zero-copy put would empty a whole step of its blocks every few puts."""
        spare = self._budget.room_bytes
        for other in self._arenas.values():
            spare += other.steps.releasable_bytes if other is arena else other.releasable_bytes
        return spare

    def _fits(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits now without deleting pages: for any tenant when
        the budget (with the free memory it could take back) holds a step of one slot, else
        when some tenant's published memory has a free slot of its class."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        if slot_bytes > self.max_page_bytes:
            return False
        return self._spare_bytes() >= PUBLISHED_HEADER_BYTES + slot_bytes or any(
            a.steps.fits(nbytes) for a in self._arenas.values())

    def _fits_for(self, arena: _Arena | None, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits in ``arena``'s published memory (None: a tenant
        with none yet) without deleting pages."""
        if arena is not None and arena.steps.fits(nbytes):
            return True
        return self._spare_bytes(arena) >= PUBLISHED_HEADER_BYTES + \
            SlabAllocator.slot_bytes_for(nbytes)

    def _step_need(self, arena: _Arena, protected: Callable[[BlockKey], bool] | None = None
                   ) -> RoomNeed:
        """Every block of ``arena``'s emptiest step: deleting them empties the step, which
        then goes back to the budget for any memory to grow into. Steps holding a block
        ``protected`` (one a lease pins, or one being copied down the chain right now) are
        passed over while another step has none: one pinned block would otherwise refuse
        every room-making that picked its step."""
        if protected is None:
            keys = min(arena.keys_by_step.values(), key=len)
        else:  # emptiest first, and only as many steps' blocks looked at as it takes
            steps = sorted(arena.keys_by_step.values(), key=len)
            keys = next((k for k in steps if not any(map(protected, k))), steps[0])
        nbytes = sum(self._entries[key].slot.slot_bytes for key in keys)
        return RoomNeed(nbytes=nbytes, tenant=arena.tenant, keys=frozenset(keys))

    async def _store(self, key: BlockKey, nbytes: int, meta: PageMeta,
                     fill: Callable[[memoryview], None]) -> _Entry | None:
        """Have ``fill`` write an ``nbytes`` page into a published slot of its tenant and enter
        it (None: no room)."""
        arena = self._arena(meta.tenant)
        found = arena.steps.allocate(nbytes) or await self._publish_slow(arena, nbytes)
        if found is None:
            self._stats.rejected += 1
            return None
        step, slot = found
        try:
            await self._fill(step.memory.view[slot.offset : slot.offset + nbytes], fill)
        except BaseException:
            if step.region in arena.steps.steps:
                arena.steps.release(step, slot)
            raise
        if key in self._entries:  # stored meanwhile by another writer: keep that copy
            arena.steps.release(step, slot)
            return self._entries[key]
        entry = self._entries[key] = _Entry(step, slot, nbytes, meta)
        arena.keys_by_step.setdefault(step.region, set()).add(key)
        self._stats.bytes_written += nbytes
        self._grow_ahead(arena, nbytes)
        return entry

    async def _publish_slow(self, arena: _Arena, nbytes: int) -> tuple[Step, Slot] | None:
        # Growth happens under the lock only, so a plan made under it cannot go stale.
        async with self._grow_lock:
            while self._is_open:
                found = arena.steps.allocate(nbytes)
                if found is not None:
                    return found
                step_bytes = arena.steps.step_bytes_for(nbytes, self._budget.room_bytes)
                if step_bytes is None:
                    if not await self._take_back(arena, PUBLISHED_HEADER_BYTES +
                                                 SlabAllocator.slot_bytes_for(nbytes)):
                        return None
                    continue
                if not await self._grow_step(arena, step_bytes):
                    return None
        return None

    async def _allocate_slow(self, arena: _Arena, nbytes: int) -> Slot | None:
        async with self._grow_lock:
            while self._is_open:
                slot = arena.alloc.allocate(nbytes)
                if slot is not None:
                    return slot
                plan = arena.alloc.growth_plan(nbytes)
                if plan is None:
                    if not await self._take_back(arena, SlabAllocator.slot_bytes_for(nbytes)):
                        return None
                    continue
                offset, need = plan
                if not need or not await self._grow_locked(arena, need, offset):
                    return None
        return None

    async def _take_back(self, arena: _Arena, need_bytes: int) -> bool:
        """Give free memory back to the budget for ``arena`` to grow (free staging chunks and
        empty published steps of other tenants, then its own empty steps: ``_spare_bytes``)
        until it holds ``need_bytes``; False (nothing given back) when all of it would not be
        enough."""
        if self._lingering:  # steps given back earlier whose clients let go since
            await self._settle_lingering(wait=False)
        short = need_bytes - self._budget.room_bytes
        if short <= 0 or self._spare_bytes(arena) < need_bytes:
            return False
        donors = sorted(self._arenas.values(),
                        key=lambda a: (a is arena, -a.releasable_bytes))
        lingering = False
        for donor in donors:
            retired = False
            staging = donor.alloc.release_free(short) if short > 0 and donor is not arena else ()
            for offset, size in staging:
                await asyncio.to_thread(donor.memory.release, offset, size)
                log.info("dram: took %d free bytes at %d back from arena %s", size, offset,
                         donor.region)
                short -= size
            for step in donor.steps.take_empty(short) if short > 0 else ():
                await asyncio.to_thread(self._retire, step)
                self._regions.pop(step.region, None)
                donor.keys_by_step.pop(step.region, None)
                if step.fetchers:  # its memory lives while they map it: charged until then
                    self._lingering.add(step.region, step.nbytes, donor.tenant, step.fetchers)
                    lingering = True
                else:
                    self._budget.grown_bytes -= step.nbytes
                log.info("dram: gave back published step %s (%d bytes) of tenant %s",
                         step.region, step.nbytes, shown(donor.tenant))
                short -= step.nbytes
                retired = True
            if retired:  # its clients' mappings keep the memory until they drop them
                for listener in self._retired_listeners:
                    listener(donor.tenant)
        if lingering:  # clients just told to drop them: those that read their session do
            await self._settle_lingering(wait=True)
        return True

    async def _settle_lingering(self, wait: bool) -> None:
        """Give the budget back the given-back steps no client process holds any more:
        ``wait``ing up to ``LINGER_WAIT_S`` for clients just told to drop them, else one look
        at most every ``LINGER_CHECK_S``."""
        now = time.monotonic()
        if not wait and now - self._lingering_checked < LINGER_CHECK_S:
            return
        deadline = now + (LINGER_WAIT_S if wait else 0.0)
        while True:
            still = await asyncio.to_thread(holders, self._lingering.snapshot())
            self._budget.grown_bytes -= self._lingering.release(still)
            if not self._lingering or time.monotonic() >= deadline:
                break
            await asyncio.sleep(LINGER_POLL_S)
        self._lingering_checked = time.monotonic()
        if wait and self._lingering:
            self._lingering.warn()

    async def _fill(self, dst: memoryview, fill: Callable[[memoryview], None]) -> None:
        """Have ``fill`` write a page into its published slot ``dst`` (in the copy thread when
        large)."""
        if dst.nbytes < THREAD_COPY_BYTES:
            fill(dst)
            return
        copy = asyncio.get_running_loop().run_in_executor(self._copier, fill, dst)
        try:
            await asyncio.shield(copy)
        except asyncio.CancelledError:
            # A cancelled wait leaves the thread writing: reuse the slot only after it ends.
            await asyncio.gather(copy, return_exceptions=True)
            raise

    def _grow_ahead(self, arena: _Arena, nbytes: int) -> None:
        idle = self._grow_task is None or self._grow_task.done()
        if idle and not self._grow_lock.locked() and self._spare_step_bytes(arena, nbytes):
            self._grow_task = asyncio.get_running_loop().create_task(self._spare(arena, nbytes))

    def _spare_step_bytes(self, arena: _Arena, nbytes: int) -> int:
        """Bytes of a whole step for pages of ``nbytes`` to grow ahead, or 0 when ``arena``
        has an empty step ready or the budget does not hold a whole one."""
        whole = arena.steps.step_bytes_for(nbytes, self.capacity_bytes) or 0
        if arena.steps.releasable_bytes or whole > self._budget.room_bytes:
            return 0
        return whole

    async def _spare(self, arena: _Arena, nbytes: int) -> None:
        async with self._grow_lock:
            step_bytes = self._spare_step_bytes(arena, nbytes)
            if self._is_open and step_bytes:
                await self._grow_step(arena, step_bytes, ahead=True)

    async def _grow_step(self, arena: _Arena, nbytes: int, ahead: bool = False) -> bool:
        """Make a published step of ``nbytes`` for ``arena`` in a thread (under the grow lock;
        ``ahead`` of demand: on the low-priority one, ``AHEAD_NICE``); False if shared memory
        ran out."""
        region = f"{self.name}.{secrets.token_hex(8)}"
        step = Step(region, SealedStep(f"kvstore-{region}", nbytes))
        try:
            # Charged once made, like staging growth: until then room checks still see the
            # budget's room, and a write that counts on it waits on the lock for this step.
            if ahead:
                await asyncio.get_running_loop().run_in_executor(self._grower, self._make_step,
                                                                 step)
            else:
                await asyncio.to_thread(self._make_step, step)
        except CapacityError as exc:
            log.warning("dram: cannot grow tenant %s's published memory: %s",
                        shown(arena.tenant), exc)
            return False
        if not self._is_open:
            await asyncio.to_thread(self._retire, step)
            return False
        self._budget.grown_bytes += nbytes
        arena.steps.add(step)
        self._regions[region] = (arena, step.memory)
        return True

    def _make_step(self, step: Step) -> None:
        step.memory.create()
        if self._pin_cuda:
            try:
                self._register(step.memory.base_address(), step.nbytes)
            except CapacityError as exc:  # the bytes stay usable, only DMA from them is slower
                log.warning("dram: step %s stays pageable: %s", step.region, exc)

    def _retire(self, step: Step) -> None:
        if self._pin_cuda and step.memory.base_address():
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostUnregister(step.memory.base_address()))
            if err:
                cudart.cudaGetLastError()  # a refusal must not fail a later CUDA call
            if err not in (0, 713):  # 713: cudaErrorHostMemoryNotRegistered (it stayed pageable)
                log.warning("dram: cudaHostUnregister failed (cudaError %d)", err)
        step.memory.retire()

    async def _grow_locked(self, arena: _Arena, nbytes: int, offset: int | None = None) -> bool:
        """Grow ``arena``'s staging memory by ``nbytes`` at ``offset`` (default: its end) in a
        thread; False if shared memory ran out."""
        offset = arena.alloc.grown_bytes if offset is None else offset
        try:
            offset = await asyncio.to_thread(self._grow_blocking, arena, nbytes, offset)
        except CapacityError as exc:
            log.warning("dram: cannot grow arena %s: %s", arena.region, exc)
            return False
        arena.alloc.add_grown(offset, nbytes)
        return True

    def _grow_blocking(self, arena: _Arena, nbytes: int, offset: int) -> int:
        offset = arena.memory.grow(nbytes, offset)
        if self._pin_cuda:
            address = arena.memory.base_address() + offset
            try:
                self._register(address, nbytes)
                arena.pinned.append(address)
            except CapacityError as exc:  # the bytes stay usable, only DMA from them is slower
                log.warning("dram: arena %s growth at %d stays pageable: %s", arena.region,
                            offset, exc)
        return offset

    @staticmethod
    def _register(address: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_FLAGS))
        if err != 0:
            raise CapacityError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})")

    def _unpin(self, arena: _Arena) -> None:
        for address in arena.pinned:
            err = int(torch.cuda.cudart().cudaHostUnregister(address))
            if err != 0:
                log.warning("dram: cudaHostUnregister failed (cudaError %d)", err)
        arena.pinned.clear()

    def _remove(self, key: BlockKey) -> None:
        entry = self._entries.pop(key)
        arena = self._arena_of(entry)
        keys = arena.keys_by_step[entry.step.region]
        keys.discard(key)
        if not keys:
            del arena.keys_by_step[entry.step.region]
        arena.steps.release(entry.step, entry.slot)

    def _arena_of(self, entry: _Entry) -> _Arena:
        return self._regions[entry.step.region][0]
