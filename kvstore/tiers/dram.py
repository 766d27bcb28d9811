"""The DRAM tier: encoded pages in fixed slots of shared-memory arenas, one arena per tenant.

Each tenant's pages live in an arena of its own, a memfd that has no path anyone could open: the
daemon hands its descriptor only to that tenant's clients (``region_fd``, served by
``kvstore.server.fdpass``), so a client maps its own tenant's pages and nobody else's. An arena
is made when its tenant first stores or reserves; all of them grow within the tier's capacity
(a shared ``GrowthBudget``), and an arena's free tail goes back to the budget when another
tenant needs the memory.

Clients can write their own arena, so every page here is sealed when the tier writes or publishes
it: a keyed tag of the page (``kvstore.page.PageSealer``, a secret that lives and dies with this
tier) kept in the tier's own memory beside the entry, out of every client's reach. A read checks
the page against its tag: a page a client forged, checksum recomputed, is a corrupt miss, never
served.

Making room is the store's job: the tier never evicts on its own. Slots come in size classes
(``SlabAllocator``): when the arenas are full, deleting a page frees room for a page of the same
class in its tenant's arena, one slot for one slot, so ``room_for(n)`` asks for one slot of the
class of ``n`` and ``footprint(key)`` reports each page's class. Memory moves between tenants
as whole chunks: a free chunk anywhere in an arena goes back to the shared budget when another
arena needs to grow. ``room_for_tenant(n, tenant)`` says whose blocks make room for a page of
``tenant``: its own (one slot of the class) while its arena is at least as large as every other
one, else every block of the emptiest chunk of the largest other arena (``RoomNeed.keys``), so
one tenant filling the tier cannot starve another, and arenas tend to equal sizes among the
tenants that store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstore.api import Medium
from kvstore.config import DramConfig
from kvstore.errors import CapacityError, CorruptPage, InvalidArgument, Unavailable, shown
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta, PageSealer, Seal, decode_page, parse_page
from kvstore.policy.base import Footprint, RoomNeed
from kvstore.tiers.arena import GrowthBudget, ShmArena, SlabAllocator, Slot, round_up
from kvstore.tiers.base import SlotTier, TierStats

log = logging.getLogger(__name__)

# Verification checks the keyed seal (BLAKE3, releases the GIL): on the 2-core box about
# 3.4 GB/s on one core, ~600 us for a 2 MiB page (measured 2026-12-02), well above a ~100 us
# thread hop, so pages from 256 KiB up are checked in a thread.
THREAD_VERIFY_BYTES = 256 << 10

# A write copies the page into its slot and seals it: the seal (~3.4 GB/s) costs more than the
# copy (~20 GB/s inline). From 256 KiB up both run in the tier's copy thread, with a copy that
# releases the GIL (a memoryview assignment holds it for the whole copy).
THREAD_COPY_BYTES = 256 << 10

MANY_CORES = (os.cpu_count() or 1) >= 4
# Which copy the thread runs (2 MiB pages into the arena, measured 2026-11-29): on the 2-core box
# numpy.copyto 9.2 GB/s, torch copy_ 8.2 (median); on a 16-core H200 host numpy.copyto 5.3 GB/s,
# torch copy_ 52 (it spreads the copy over cores). One copy thread, so copies never stack up
# several OpenMP teams on the same cores.
PARALLEL_COPY = MANY_CORES and torch.get_num_threads() >= 4

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
    """One tenant's memfd, the allocator that carves it and the region name clients ask for."""

    tenant: str
    region: str
    memory: ShmArena
    alloc: SlabAllocator
    pinned: list[int] = field(default_factory=list)  # registered host addresses
    keys_by_chunk: dict[int, set[BlockKey]] = field(default_factory=dict)  # chunk offset -> keys


@dataclass(frozen=True, slots=True)
class ArenaSlot:
    """A slot in one tenant's arena: the ``Slot`` this tier lends."""

    arena: _Arena
    slot: Slot

    @property
    def offset(self) -> int:
        return self.slot.offset

    @property
    def slot_bytes(self) -> int:
        return self.slot.slot_bytes


@dataclass(slots=True)
class _Entry:
    slot: ArenaSlot
    length: int  # page bytes (the slot may be longer)
    meta: PageMeta
    seal: Seal  # the page's tag when the tier stored it; a page that no longer matches is corrupt


def _verified_copy(view: memoryview, key: BlockKey, seal: Seal) -> Page:
    return decode_page(bytes(view), key, seal)


def _copy_large(dst: memoryview, src: memoryview) -> None:
    if PARALLEL_COPY:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class DramTier(SlotTier):
    """Pages in slab-allocated memfd arenas, one per tenant; reads are views into them.

    An arena grows in ``chunk_bytes`` steps, in a thread, one chunk ahead of demand, so the
    request path rarely waits on page faults. ``region_of(tenant)``, ``region_fd(region)`` and
    ``locate(key)`` let a client of that tenant map its arena and read a page in place.
    """

    name = "dram"

    def __init__(self, config: DramConfig, name: str = "dram") -> None:
        self.name = name
        self.config = config
        self._budget = GrowthBudget(config.capacity_bytes)
        self._arenas: dict[str, _Arena] = {}  # by tenant
        self._regions: dict[str, _Arena] = {}  # by region name
        self._sealer = PageSealer()  # a fresh secret per tier: seals die with the process
        self._entries: dict[BlockKey, _Entry] = {}
        self._pending: dict[BlockKey, asyncio.Future[bool]] = {}
        self._grow_lock = asyncio.Lock()  # one for all arenas: they grow within one budget
        self._grow_task: asyncio.Task[None] | None = None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvstore-dram-copy")
        self._pin_cuda = False
        self._is_open = False
        self._stats = TierStats(name=self.name)

    @property
    def medium(self) -> Medium:
        return Medium.HOST

    @property
    def max_page_bytes(self) -> int:
        return self._budget.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._budget.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return sum(arena.alloc.used_bytes for arena in self._arenas.values())

    def region_of(self, tenant: str) -> str:
        """The region name of ``tenant``'s arena (made now if the tenant has none yet)."""
        return self._arena(tenant).region

    def region_fd(self, region: str) -> tuple[str, int] | None:
        """``(tenant, memfd)`` of the arena named ``region``, or None if there is none. The
        descriptor stays the tier's: send or duplicate it, never close it."""
        arena = self._regions.get(region) if self._is_open else None
        return None if arena is None else (arena.tenant, arena.memory.fd)

    def arena_path(self, tenant: str) -> str | None:
        """A path through which this process, and only it, can open ``tenant``'s arena
        (``/proc/self/fd/N``), or None if the tenant has none: for tests and tools."""
        arena = self._arenas.get(tenant)
        return None if arena is None else f"/proc/self/fd/{arena.memory.fd}"

    async def open(self) -> None:
        """Get ready; arenas are made as tenants first store, no memory is grown yet."""
        if not hasattr(os, "memfd_create"):
            raise Unavailable("the dram tier needs memfd_create (Linux 3.17 or later)")
        self._is_open = True

    async def close(self) -> None:
        """Wait for growth in flight, unpin and close every arena. Pages are dropped."""
        if not self._is_open:
            return
        self._is_open = False
        if self._grow_task is not None:  # it takes the lock itself, then sees the tier closed
            await asyncio.gather(self._grow_task, return_exceptions=True)
        async with self._grow_lock:  # a write may still be growing an arena
            self._entries.clear()
            for arena in self._arenas.values():
                self._unpin(arena)
                arena.memory.close()
            self._arenas.clear()
            self._regions.clear()
        self._copier.shutdown(wait=False)

    async def reserve(self, nbytes: int, tenant: str) -> int:
        """Grow and prefault ``tenant``'s arena to ``nbytes`` (within the budget) ahead of
        demand.

        Grows one chunk at a time in a thread, so writes interleave and the loop stays free
        (prefaulting runs at about 0.4 GB/s). Returns the arena's grown size in bytes.
        """
        arena = self._arena(tenant)
        target = min(round_up(max(nbytes, 0)), self.capacity_bytes)
        while self._is_open and arena.alloc.grown_bytes < target:
            async with self._grow_lock:
                step = min(arena.alloc.chunk_bytes, target - arena.alloc.grown_bytes,
                           self._budget.room_bytes)
                if not self._is_open or step <= 0 or not await self._grow_locked(arena, step):
                    break
        return arena.alloc.grown_bytes

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    def room_for(self, nbytes: int) -> RoomNeed | None:
        if self._is_open and self._fits(nbytes):
            return None
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        return RoomNeed(nbytes=slot_bytes, size_class=slot_bytes)

    def room_for_tenant(self, nbytes: int, tenant: str) -> RoomNeed | None:
        """None if ``tenant``'s page of ``nbytes`` fits now (in its arena, or by taking free
        chunks back from other arenas); else whose blocks to delete: one slot of the page's
        class from ``tenant``'s own blocks while its arena is at least as large as every other
        one, else every block of the emptiest chunk of the largest other arena (larger by more
        than one slot, so two tenants do not take a chunk back and forth)."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        own_need = RoomNeed(nbytes=slot_bytes, size_class=slot_bytes, tenant=tenant)
        if not self._is_open or slot_bytes > self.capacity_bytes:
            return own_need
        arena = self._arenas.get(tenant)
        if self._fits_for(arena, nbytes):
            return None
        own_bytes = arena.alloc.backed_bytes if arena is not None else 0
        donor = max((a for a in self._arenas.values() if a is not arena and a.keys_by_chunk),
                    key=lambda a: a.alloc.backed_bytes, default=None)
        if donor is not None and donor.alloc.backed_bytes > own_bytes + slot_bytes:
            return self._chunk_need(donor)
        # Its own blocks of other classes are not emptied for it: the page goes down the chain.
        return own_need

    def footprint(self, key: BlockKey) -> Footprint | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        return Footprint(size_class=entry.slot.slot_bytes, nbytes=entry.slot.slot_bytes)

    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        """Copy ``page`` into a slot of its tenant's arena and seal it there; False (counted
        ``rejected``) when there is no room."""
        self._check_open()
        if key in self._entries:
            return True
        if key in self._pending:
            return await asyncio.shield(self._pending[key])
        view = memoryview(page).cast("B")
        try:
            if meta.key != key or len(parse_page(view, key).data) != view.nbytes:
                raise CorruptPage(f"its meta names key {bytes(meta.key).hex()}")
        except CorruptPage as exc:
            raise InvalidArgument(f"dram write of key {bytes(key).hex()}: not a whole page "
                                  f"of that key: {exc}") from None
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[key] = done
        try:
            stored = await self._store(key, view, meta)
        finally:
            del self._pending[key]
            done.set_result(key in self._entries)
        return stored

    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """The page of ``key`` checked against its seal; None on a miss.

        A verified read returns a private copy, checked after it was copied: the tenant's
        clients can write the arena, so bytes checked in place could change before the caller
        uses them. A page that fails is removed and counted in ``corrupt`` and ``misses``.
        ``verify=False`` only parses the header and meta, on the loop, and returns a view into
        the arena whose seal ``verify_page`` checks (the Tier contract in
        ``kvstore.tiers.base``).
        """
        self._check_open()
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        offset = entry.slot.offset
        view = entry.slot.arena.memory.view[offset : offset + entry.length]
        try:
            if not verify:
                page = parse_page(view, key, entry.seal)
            elif entry.length >= THREAD_VERIFY_BYTES:
                page = await asyncio.to_thread(_verified_copy, view, key, entry.seal)
            else:
                page = _verified_copy(view, key, entry.seal)
        except CorruptPage as exc:
            log.warning("dram: dropping corrupt page %s at offset %d: %s",
                        bytes(key).hex(), offset, exc)
            if self._entries.get(key) is entry:
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

    def locate(self, key: BlockKey) -> tuple[int, int] | None:
        """``(offset, length)`` of the page of ``key`` in its tenant's arena, or None.

        Offsets are multiples of 4096, so a reader can mmap exactly the page.
        """
        entry = self._entries.get(key)
        return None if entry is None else (entry.slot.offset, entry.length)

    # Zero-copy writers (the store's reservations): a slot is handed out, a client of the tenant
    # writes an encoded page into its mapped arena, then the store verifies and publishes it.

    async def allocate_slot(self, nbytes: int, tenant: str) -> ArenaSlot | None:
        """A free slot of at least ``nbytes`` in ``tenant``'s arena that no key owns yet; None
        when there is no room."""
        self._check_open()
        arena = self._arena(tenant)
        slot = arena.alloc.allocate(nbytes) or await self._allocate_slow(arena, nbytes)
        if slot is None:
            self._stats.rejected += 1
            return None
        return ArenaSlot(arena, slot)

    def slot_view(self, slot: ArenaSlot) -> memoryview:
        """The whole slot in its arena (writable)."""
        return slot.arena.memory.view[slot.offset : slot.offset + slot.slot_bytes]

    async def publish(self, slot: ArenaSlot, key: BlockKey, meta: PageMeta,
                      page: bytes | memoryview) -> int:
        """Seal the page a writer put into ``slot`` and make it readable as ``key``; return
        its length.

        ``page`` is the store's verified private copy of the slot's page: the seal is made over
        it, so if the writer changed the slot since, the slot fails its seal on every read.
        """
        self._check_open()
        view = memoryview(page).cast("B")
        if meta.key != key or meta.tenant != slot.arena.tenant or view.nbytes > slot.slot_bytes:
            raise InvalidArgument(f"page for key {bytes(key).hex()} does not fit this slot of "
                                  f"tenant {shown(slot.arena.tenant)}'s arena")
        if view.nbytes >= THREAD_VERIFY_BYTES:
            seal = await asyncio.to_thread(self._sealer.seal, view)
        else:
            seal = self._sealer.seal(view)
        self._check_open()
        if key in self._entries:  # stored meanwhile by a plain write: keep that copy
            slot.arena.alloc.release(slot.slot)
            return self._entries[key].length
        self._add_entry(key, _Entry(slot, view.nbytes, meta, seal))
        self._stats.bytes_written += view.nbytes
        return view.nbytes

    def abort(self, slot: ArenaSlot) -> None:
        """Give back a slot that was never published."""
        slot.arena.alloc.release(slot.slot)

    def stats(self) -> TierStats:
        s = self._stats
        allocs = [arena.alloc for arena in self._arenas.values()]
        return TierStats(
            name=self.name, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
            num_blocks=len(self._entries), hits=s.hits, misses=s.misses,
            corrupt=s.corrupt, rejected=s.rejected, bytes_read=s.bytes_read,
            bytes_written=s.bytes_written,
            extra={
                "arena_bytes": self._budget.grown_bytes,
                "arenas": len(allocs),
                "slot_classes": sum(a.num_classes for a in allocs),
                "free_slots": sum(a.num_free_slots for a in allocs),
            },
        )

    async def pin_cuda(self) -> bool:
        """Register the arenas as pinned host memory (cudaHostRegister), now and as they grow.

        Costs about 0.5 s per GiB registered (DESIGN.md), paid in a thread: now for the parts
        already grown, later inside each growth step. Returns False, doing nothing, without CUDA.
        """
        self._check_open()
        if not torch.cuda.is_available():
            return False
        async with self._grow_lock:
            if not self._pin_cuda:
                for arena in self._arenas.values():
                    for offset, nbytes in arena.alloc.backed_ranges():  # holes hold no memory
                        await asyncio.to_thread(self._register, arena, offset, nbytes)
                    arena.alloc.merge_growth = False  # later growth: registrations of their own
            self._pin_cuda = True
        return True

    # --- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._is_open:
            raise Unavailable("dram tier is not open (call open() first, or it was closed)")

    def _arena(self, tenant: str) -> _Arena:
        """``tenant``'s arena, made on first use (a sealed memfd; nothing grown yet)."""
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
        arena = self._arenas[tenant] = self._regions[region] = _Arena(tenant, region, memory,
                                                                        alloc)
        log.info("dram: made arena %s for tenant %s", region, shown(tenant))
        return arena

    def _fits(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits now without deleting pages: for any tenant when
        the budget (with the free chunks it could take back) holds a slot, else when some
        arena has a free slot or region of its class (its own tenant's page fits)."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        if slot_bytes > self.capacity_bytes:
            return False
        arenas = self._arenas.values()
        spare = self._budget.room_bytes + sum(a.alloc.releasable_bytes for a in arenas)
        return spare >= slot_bytes or any(a.alloc.fits(nbytes) for a in arenas)

    def _fits_for(self, arena: _Arena | None, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits in ``arena`` (None: one not made yet) without
        deleting pages: in its free space, by growing within the budget, or by growing into
        free chunks other arenas give back."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        if arena is not None and arena.alloc.growth_plan(nbytes) is not None:
            return True
        others = sum(a.alloc.releasable_bytes for a in self._arenas.values() if a is not arena)
        return self._budget.room_bytes + others >= slot_bytes

    def _chunk_need(self, arena: _Arena) -> RoomNeed:
        """Every block of ``arena``'s emptiest chunk: deleting them frees the whole chunk,
        which then goes back to the budget for any arena to grow into."""
        keys = min(arena.keys_by_chunk.values(), key=len)
        nbytes = sum(self._entries[key].slot.slot_bytes for key in keys)
        return RoomNeed(nbytes=nbytes, tenant=arena.tenant, keys=frozenset(keys))

    def _add_entry(self, key: BlockKey, entry: _Entry) -> None:
        self._entries[key] = entry
        arena = entry.slot.arena
        arena.keys_by_chunk.setdefault(arena.alloc.chunk_of(entry.slot.slot), set()).add(key)

    async def _store(self, key: BlockKey, view: memoryview, meta: PageMeta) -> bool:
        arena = self._arena(meta.tenant)
        slot = arena.alloc.allocate(view.nbytes) or await self._allocate_slow(arena, view.nbytes)
        if slot is None:
            self._stats.rejected += 1
            return False
        lent = ArenaSlot(arena, slot)
        seal = await self._copy_in(lent, view)
        if key in self._entries:  # a reservation published it meanwhile: keep that copy
            arena.alloc.release(slot)
            return True
        self._add_entry(key, _Entry(lent, view.nbytes, meta, seal))
        self._stats.bytes_written += view.nbytes
        self._grow_ahead(arena)
        return True

    async def _allocate_slow(self, arena: _Arena, nbytes: int) -> Slot | None:
        # Growth happens under the lock only, so a plan made under it cannot go stale.
        async with self._grow_lock:
            while self._is_open:
                slot = arena.alloc.allocate(nbytes)
                if slot is not None:
                    return slot
                plan = arena.alloc.growth_plan(nbytes)
                if plan is None:
                    if not await self._take_back(arena, nbytes):
                        return None
                    continue
                offset, need = plan
                if not need or not await self._grow_locked(arena, need, offset):
                    return None
        return None

    async def _take_back(self, arena: _Arena, nbytes: int) -> bool:
        """Give other arenas' free chunks back to the budget until ``arena`` can grow for a
        page of ``nbytes``; False (nothing given back) when all of them would not be enough."""
        short = SlabAllocator.slot_bytes_for(nbytes) - self._budget.room_bytes
        others = sorted((a for a in self._arenas.values() if a is not arena),
                        key=lambda a: -a.alloc.releasable_bytes)
        if short <= 0 or sum(a.alloc.releasable_bytes for a in others) < short:
            return False
        for other in others:
            if short <= 0:
                break
            for offset, size in other.alloc.release_free(short):
                await asyncio.to_thread(other.memory.release, offset, size)
                log.info("dram: took %d free bytes at %d back from arena %s", size, offset,
                         other.region)
                short -= size
        return True

    async def _copy_in(self, slot: ArenaSlot, view: memoryview) -> Seal:
        """Copy a page into its slot; return its seal, made over the source (which only the
        daemon can write). On failure the slot goes back once nothing writes to it."""
        dst = slot.arena.memory.view[slot.offset : slot.offset + view.nbytes]
        if view.nbytes < THREAD_COPY_BYTES:
            return self._copy_and_seal(dst, view)
        copy = asyncio.get_running_loop().run_in_executor(self._copier, self._copy_and_seal,
                                                          dst, view)
        try:
            return await asyncio.shield(copy)
        except BaseException:
            # A cancelled wait leaves the thread writing: reuse the slot only after it ends.
            copy.add_done_callback(lambda _: slot.arena.alloc.release(slot.slot))
            raise

    def _copy_and_seal(self, dst: memoryview, src: memoryview) -> Seal:
        seal = self._sealer.seal(src)
        if src.nbytes < THREAD_COPY_BYTES:
            dst[:] = src
        else:
            _copy_large(dst, src)
        return seal

    def _grow_ahead(self, arena: _Arena) -> None:
        idle = self._grow_task is None or self._grow_task.done()
        if idle and not self._grow_lock.locked() and arena.alloc.spare_growth():
            self._grow_task = asyncio.get_running_loop().create_task(self._spare(arena))

    async def _spare(self, arena: _Arena) -> None:
        async with self._grow_lock:
            offset, need = arena.alloc.spare_plan()
            if need and self._is_open:
                await self._grow_locked(arena, need, offset)

    async def _grow_locked(self, arena: _Arena, nbytes: int, offset: int | None = None) -> bool:
        """Grow ``arena`` by ``nbytes`` at ``offset`` (default: its end) in a thread; False if
        shared memory ran out."""
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
            try:
                self._register(arena, offset, nbytes)
            except CapacityError as exc:  # the bytes stay usable, only DMA from them is slower
                log.warning("dram: arena %s growth at %d stays pageable: %s", arena.region,
                            offset, exc)
        return offset

    def _register(self, arena: _Arena, offset: int, nbytes: int) -> None:
        address = arena.memory.base_address() + offset
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_FLAGS))
        if err != 0:
            raise CapacityError(f"cudaHostRegister of {nbytes} arena bytes failed (cudaError {err})")
        arena.pinned.append(address)

    def _unpin(self, arena: _Arena) -> None:
        for address in arena.pinned:
            err = int(torch.cuda.cudart().cudaHostUnregister(address))
            if err != 0:
                log.warning("dram: cudaHostUnregister failed (cudaError %d)", err)
        arena.pinned.clear()

    def _remove(self, key: BlockKey) -> None:
        entry = self._entries.pop(key)
        arena = entry.slot.arena
        chunk = arena.alloc.chunk_of(entry.slot.slot)
        keys = arena.keys_by_chunk[chunk]
        keys.discard(key)
        if not keys:
            del arena.keys_by_chunk[chunk]
        arena.alloc.release(entry.slot.slot)
