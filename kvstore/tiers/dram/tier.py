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
  is ever served from it. What a client makes it hold outside the slots lent (its mapping
  spans the whole arena) is punched out and charged (``kvstore.tiers.dram.overreach``).

All of it grows within the tier's capacity (a shared ``GrowthBudget``). A sealed step cannot
give part of its memory back (the seal refuses MADV_REMOVE and hole punching): it goes back
whole once none of its slots holds a page, when another tenant's memory needs to grow (or the
tier closes); its header then says it is retired, so clients drop their mappings of it, and the
step is cut down to that header page, so its memory is freed whoever still maps it
(``kvstore.tiers.dram.lingering``).

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
import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.api import Medium
from kvstore.config import DramConfig
from kvstore.errors import CorruptPage, InvalidArgument, Unavailable
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
from kvstore.tiers.dram.arena import SealedStep, Step
from kvstore.tiers.dram.growth import Growth, TenantMemory
from kvstore.tiers.dram.slabs import SlabAllocator, Slot
from kvstore.tiers.dram.staging import ArenaSlot, PublishClaim, Staging

log = logging.getLogger("kvstore.tiers.dram")  # the DRAM tier's logger: these are its messages

# A write copies the page into its slot (~20 GB/s inline): from 256 KiB up (over ~13 us of
# copying, against a ~100 us thread hop only worth paying for the loop's sake) it runs in the
# tier's copy thread, with a copy that releases the GIL (a memoryview assignment holds it).
THREAD_COPY_BYTES = 256 << 10

MANY_CORES = (os.cpu_count() or 1) >= 4
# Which copy the thread runs (2 MiB pages into the arena, measured 2026-11-29): on the 2-core box
# numpy.copyto 9.2 GB/s, torch copy_ 8.2 (median); on a 16-core H200 host numpy.copyto 5.3 GB/s,
# torch copy_ 52 (it spreads the copy over cores). One copy thread, so copies never stack up
# several OpenMP teams on the same cores.
PARALLEL_COPY = MANY_CORES and torch.get_num_threads() >= 4

# Page bytes are only ever read as a copy source; torch warns about any read-only buffer.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


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
    request path rarely waits on page faults (``Growth``); zero-copy writers' slots and the
    checked copies of their pages are ``Staging``'s. ``region_of(tenant)`` (staging),
    ``locate(key)`` (a page's step and place) and ``region_fd(region)`` let a client of that
    tenant map its memory and read a page in place.
    """

    name = "dram"

    def __init__(self, config: DramConfig, name: str = "dram") -> None:
        self.name = name
        self.config = config
        self._growth = Growth(name, config, make_step=self._make_step)
        self._budget = self._growth.budget
        self._arenas = self._growth.arenas  # by tenant
        self._regions = self._growth.regions  # by region name: (tenant memory, its memfd)
        self._entries: dict[BlockKey, _Entry] = {}
        self._pending: dict[BlockKey, asyncio.Future[bool]] = {}
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvstore-dram-copy")
        self._stats = TierStats(name=self.name)
        self._staging = Staging(self._growth, self._stats)

    @property
    def _is_open(self) -> bool:
        return self._growth.is_open

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
        None if there is none (or it was given back); a published step's is read-only
        (``SealedStep.client_fd``). The descriptor stays the tier's: send or duplicate it,
        never close it."""
        found = self._regions.get(region) if self._is_open else None
        if found is None:
            return None
        memory = found[1]
        return found[0].tenant, memory.client_fd if isinstance(memory, SealedStep) else memory.fd

    def on_retired(self, listener: Callable[[str], None]) -> None:
        """``FdRegions.on_retired``: called with the tenant whose published steps went back."""
        self._growth.on_retired(listener)

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
        self._growth.is_open = True
        self._growth.overreach.start()

    async def close(self) -> None:
        """Wait for growth in flight, unpin and close all memory. Pages are dropped."""
        if not self._is_open:
            return
        await self._growth.close(forget=self._entries.clear)
        self._copier.shutdown(wait=False)
        self._staging.close()

    async def reserve(self, nbytes: int, tenant: str) -> int:
        """Grow ``tenant``'s published memory to ``nbytes`` (within the budget) ahead of demand,
        in empty steps cut for whichever class comes first.

        Grows one step at a time in a thread, so writes interleave and the loop stays free
        (prefaulting runs at about 0.4 GB/s). Returns the tenant's published bytes.
        """
        return await self._growth.reserve(self._arena(tenant), nbytes)

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    def room_for(self, nbytes: int) -> RoomNeed | None:
        if self._is_open and self._growth.fits(nbytes):
            return None
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        return RoomNeed(nbytes=slot_bytes, size_class=slot_bytes)

    def room_for_tenant(self, nbytes: int, tenant: str,
                        protected: Callable[[BlockKey], bool] | None = None
                        ) -> RoomNeed | None:
        """None if ``tenant``'s page of ``nbytes`` fits now in its published memory (in a free
        slot, by growing a step, or by taking free memory back from anyone); else whose blocks
        to delete: one slot of the page's class from ``tenant``'s own blocks while its memory
        is at least as large as every other tenant's (or it may not take theirs:
        ``Growth.may_take_from_others``), else every block of the emptiest step of the largest
        other one (larger by more than one slot, so two tenants do not take a step back and
        forth). The step is one with no block ``protected`` where there is one."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        own_need = RoomNeed(nbytes=slot_bytes, size_class=slot_bytes, tenant=tenant)
        if not self._is_open or slot_bytes > self.max_page_bytes:
            return own_need
        arena = self._arenas.get(tenant)
        if self._growth.fits_for(arena, nbytes):
            return None
        own_bytes = arena.backed_bytes if arena is not None else 0
        donor = max((a for a in self._arenas.values() if a is not arena and a.keys_by_step),
                    key=lambda a: a.backed_bytes, default=None)
        if (donor is not None and donor.backed_bytes > own_bytes + slot_bytes
                and self._growth.may_take_from_others(arena)):
            return self._step_need(donor, protected)
        # Its own blocks of other classes are not emptied for it: the page goes down the chain.
        return own_need

    def room_for_slot(self, nbytes: int, tenant: str,
                      protected: Callable[[BlockKey], bool] | None = None) -> RoomNeed | None:
        """None if a staging slot of ``nbytes`` for ``tenant`` can be had now (free staging
        memory, growth within the budget, free memory taken back); else every block of the
        emptiest step of the largest tenant's memory (its own too; only its own when it may
        not take others': ``Growth.may_take_from_others``) that holds no block ``protected``
        (where there is one): the step then goes back to the budget and staging grows into
        it."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        any_need = RoomNeed(nbytes=slot_bytes, tenant=tenant)
        if not self._is_open or slot_bytes > self.capacity_bytes:
            return any_need
        arena = self._arenas.get(tenant)
        if arena is not None and arena.alloc.growth_plan(nbytes) is not None:
            return None
        if self._growth.spare_bytes(arena) >= slot_bytes:
            return None
        may_take = self._growth.may_take_from_others(arena)
        donor = max((a for a in self._arenas.values()
                     if a.keys_by_step and (a is arena or may_take)),
                    key=lambda a: a.backed_bytes, default=None)
        return any_need if donor is None else self._step_need(donor, protected)

    async def held_outside(self) -> dict[str, int]:
        """Given-back steps whose memory is not freed yet (a view here still reads them), by
        tenant (``lingering``; tried again at most every ``LINGER_CHECK_S``), and staging memory
        a tenant's client holds outside what was lent that a punch could not free
        (``overreach``)."""
        if self._growth.lingering:
            await self._growth.settle_lingering()
        held = self._growth.lingering.nbytes_by_tenant()
        for tenant, nbytes in self._growth.overreach.charged.items():
            held[tenant] = held.get(tenant, 0) + nbytes
        return held

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
    # (``publish``): one copy, checked where the writer cannot reach it (``Staging``).

    async def allocate_slot(self, nbytes: int, tenant: str) -> ArenaSlot | None:
        """A free staging slot of at least ``nbytes`` in ``tenant``'s arena; None when there is
        no room."""
        self._check_open()
        return await self._staging.allocate_slot(nbytes, self._arena(tenant))

    def slot_view(self, slot: ArenaSlot) -> memoryview:
        """The whole staging slot in its arena (writable, by its writer too)."""
        return self._staging.slot_view(slot)

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
        return await self._staging.claim(slot, key, nbytes, check)

    async def checked(self, claim: PublishClaim) -> PageMeta:
        """Wait for ``claim``'s copy and check: the page's meta, or what the check raised
        (InvalidArgument when its meta names another key or tenant)."""
        return await self._staging.checked(claim)

    def publish(self, claim: PublishClaim) -> int:
        """Enter ``claim``'s checked copy as its key (a copy stored meanwhile by another writer
        is kept instead) and free the staging slot; the page's length."""
        meta = claim.done.result()
        arena = claim.slot.arena
        self.abort(claim.slot)
        entry = self._entries.get(claim.key)
        if entry is not None or claim.step.region not in arena.steps.steps:
            self._staging.release_claim(claim)
            return 0 if entry is None else entry.length
        self._entries[claim.key] = _Entry(claim.step, claim.published, claim.nbytes, meta)
        arena.keys_by_step.setdefault(claim.step.region, set()).add(claim.key)
        self._stats.bytes_written += claim.nbytes
        self._growth.grow_ahead(arena, claim.nbytes)
        return claim.nbytes

    def drop(self, claim: PublishClaim) -> None:
        """Give ``claim``'s published slot back once its copy is done (a thread still writing
        it must not write into a slot lent again); the staging slot stays the caller's."""
        self._staging.drop(claim)

    def abort(self, slot: ArenaSlot) -> None:
        """Give back a staging slot that was never published."""
        self._staging.abort(slot)

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
                # given back, not freed yet (read here still): charged until it is
                "lingering_bytes": self._growth.lingering.nbytes,
                # held by staging arenas outside what was lent (touched by a client): charged
                # until a sweep punches it out (``kvstore.tiers.dram.overreach``)
                "staging_outside_bytes": self._growth.overreach.nbytes,
                "staging_punched_bytes": self._growth.overreach.punched_bytes,
            },
        )

    async def pin_cuda(self) -> bool:
        """Register all memory as pinned host memory (cudaHostRegister), now and as it grows.

        Costs about 0.5 s per GiB registered (DESIGN.md), paid in a thread: now for what is
        already grown, later inside each growth step. Returns False, doing nothing, without
        CUDA.
        """
        self._check_open()
        return await self._growth.pin_cuda()

    # --- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._is_open:
            raise Unavailable("dram tier is not open (call open() first, or it was closed)")

    def _arena(self, tenant: str) -> TenantMemory:
        """``tenant``'s memory, made on first use (a sealed staging memfd; nothing grown)."""
        self._check_open()
        return self._growth.arena(tenant)

    def _make_step(self, step: Step) -> None:
        """Back a new published step (``Growth`` calls this in a growth thread)."""
        self._growth.back_step(step)

    async def _settle_lingering(self) -> None:
        """``Growth.settle_lingering``: free now the given-back steps no view here reads."""
        await self._growth.settle_lingering(now=True)

    def _step_need(self, arena: TenantMemory, protected: Callable[[BlockKey], bool] | None = None
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
        found = await self._growth.published_slot(arena, nbytes)
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
        self._growth.grow_ahead(arena, nbytes)
        return entry

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

    def _remove(self, key: BlockKey) -> None:
        entry = self._entries.pop(key)
        arena = self._arena_of(entry)
        keys = arena.keys_by_step[entry.step.region]
        keys.discard(key)
        if not keys:
            del arena.keys_by_step[entry.step.region]
        arena.steps.release(entry.step, entry.slot)

    def _arena_of(self, entry: _Entry) -> TenantMemory:
        return self._regions[entry.step.region][0]
