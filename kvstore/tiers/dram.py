"""The DRAM tier: encoded pages in fixed slots of a shared-memory arena other processes can map.

Making room is the store's job: the tier never evicts on its own. Slots come in size classes
(``SlabAllocator``): when the arena is full, deleting a page frees room for a page of the same
class, one slot for one slot, so ``room_for(n)`` asks for one slot of the class of ``n`` and
``footprint(key)`` reports each page's class. (Emptying a whole chunk would also free room for
any class; the store's watermark demotion does that over time.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import tempfile
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.api import Medium
from kvstore.config import DramConfig
from kvstore.errors import CapacityError, CorruptPage, InvalidArgument, Unavailable
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta, decode_page, page_length, parse_page
from kvstore.policy.base import Footprint, RoomNeed
from kvstore.tiers.arena import ShmArena, SlabAllocator, Slot, reclaim_stale_arenas, round_up
from kvstore.tiers.base import SlotTier, TierStats

log = logging.getLogger(__name__)

# Verification (xxh3) releases the GIL. On the 2-core box it runs at ~28 GB/s: a 2 MiB page takes
# ~70 us inline, less than a thread hop. On a 16-core H200 host one core hashes at only ~6.8 GB/s
# (~300 us a page), and in threads gathered reads verify on many cores at once.
MANY_CORES = (os.cpu_count() or 1) >= 4
THREAD_VERIFY_BYTES = (1 << 20) if MANY_CORES else (8 << 20)

# A thread hop costs ~100 us on the 2-core dev box, a 1 MiB copy ~50 us (memoryview
# assignment, ~20 GB/s): below 1 MiB copy inline, above it in the tier's copy thread with a
# copy that releases the GIL (a memoryview assignment holds it for the whole copy).
THREAD_COPY_BYTES = 1 << 20

# Which copy the thread runs (2 MiB pages into the arena, measured 2026-11-29): on the 2-core box
# numpy.copyto 9.2 GB/s, torch copy_ 8.2 (median); on a 16-core H200 host numpy.copyto 5.3 GB/s,
# torch copy_ 52 (it spreads the copy over cores). One copy thread, so copies never stack up
# several OpenMP teams on the same cores.
PARALLEL_COPY = MANY_CORES and torch.get_num_threads() >= 4

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and addressable
# from kernels through unified addressing.
_CUDA_HOST_REGISTER_FLAGS = 1 | 2
_arena_counter = itertools.count()
# Page bytes are only ever read as a copy source; torch warns about any read-only buffer.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


@dataclass(slots=True)
class _Entry:
    slot: Slot
    length: int  # page bytes (the slot may be longer)
    meta: PageMeta


def _shm_dir(configured: str) -> str:
    return configured if os.path.isdir(configured) else tempfile.gettempdir()


def _copy_large(dst: memoryview, src: memoryview) -> None:
    if PARALLEL_COPY:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class DramTier(SlotTier):
    """Pages in a slab-allocated shared-memory arena; reads are zero-copy views into it.

    The arena grows in ``chunk_bytes`` steps, in a thread, one chunk ahead of demand, so the
    request path rarely waits on page faults. ``arena_path`` and ``locate(key)`` let another
    process on the host map the file and read a page in place.
    """

    name = "dram"

    def __init__(self, config: DramConfig, name: str = "dram") -> None:
        self.name = name
        self.config = config
        self._alloc = SlabAllocator(config.capacity_bytes, config.chunk_bytes)
        path = os.path.join(_shm_dir(config.shm_dir),
                            f"kvstore-dram-{os.getpid()}-{next(_arena_counter)}-{secrets.token_hex(4)}.arena")
        self._arena = ShmArena(path, config.capacity_bytes)
        self._entries: dict[BlockKey, _Entry] = {}
        self._pending: dict[BlockKey, asyncio.Future[bool]] = {}
        self._grow_lock = asyncio.Lock()
        self._grow_task: asyncio.Task[None] | None = None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvstore-dram-copy")
        self._pinned: list[int] = []  # registered host addresses, unregistered at close
        self._pin_cuda = False
        self._is_open = False
        self._stats = TierStats(name=self.name)

    @property
    def arena_path(self) -> str:
        """Path of the arena file (map it MAP_SHARED to read pages at ``locate`` offsets)."""
        return self._arena.path

    @property
    def medium(self) -> Medium:
        return Medium.HOST

    @property
    def region(self) -> str:
        return self._arena.path

    @property
    def max_page_bytes(self) -> int:
        return self._alloc.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    async def open(self) -> None:
        """Create the arena file and reserve its mapping; no memory is grown yet."""
        if not self._is_open:
            for path in reclaim_stale_arenas(os.path.dirname(self._arena.path)):
                log.info("dram: removed the arena of a dead process: %s", path)
            self._arena.create()
            self._is_open = True

    async def close(self) -> None:
        """Wait for growth in flight, unpin, unmap and unlink the arena. Pages are dropped."""
        if not self._is_open:
            return
        self._is_open = False
        if self._grow_task is not None:  # it takes the lock itself, then sees the tier closed
            await asyncio.gather(self._grow_task, return_exceptions=True)
        async with self._grow_lock:  # a write may still be growing the arena
            self._unpin()
            self._entries.clear()
            self._arena.close()
        self._copier.shutdown(wait=False)

    async def reserve(self, nbytes: int) -> int:
        """Grow and prefault the arena to ``nbytes`` (at most capacity) ahead of demand.

        Grows one chunk at a time in a thread, so writes interleave and the loop stays free
        (prefaulting runs at about 0.4 GB/s on tmpfs). Returns the arena's size in bytes.
        """
        self._check_open()
        target = min(round_up(max(nbytes, 0)), self.capacity_bytes)
        while self._is_open and self._alloc.grown_bytes < target:
            async with self._grow_lock:
                step = min(self._alloc.chunk_bytes, target - self._alloc.grown_bytes)
                if not self._is_open or step <= 0 or not await self._grow_locked(step):
                    break
        return self._alloc.grown_bytes

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    def room_for(self, nbytes: int) -> RoomNeed | None:
        if self._is_open and self._alloc.plan_growth(nbytes) is not None:
            return None
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        return RoomNeed(nbytes=slot_bytes, size_class=slot_bytes)

    def footprint(self, key: BlockKey) -> Footprint | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        return Footprint(size_class=entry.slot.slot_bytes, nbytes=entry.slot.slot_bytes)

    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        """Copy ``page`` into a slot; False (counted ``rejected``) when there is no room."""
        self._check_open()
        if key in self._entries:
            return True
        if key in self._pending:
            return await asyncio.shield(self._pending[key])
        view = memoryview(page).cast("B")
        if view.nbytes == 0 or meta.key != key:
            raise InvalidArgument(
                f"dram write of key {bytes(key).hex()}: page is empty or its meta names key "
                f"{bytes(meta.key).hex()}"
            )
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[key] = done
        try:
            stored = await self._store(key, view, meta)
        finally:
            del self._pending[key]
            done.set_result(key in self._entries)
        return stored

    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """The verified page, its payload a view into the arena; None on a miss.

        A page that fails verification is removed and counted in ``corrupt`` and ``misses``.
        ``verify=False`` only parses the header and meta, on the loop, and leaves the checksum
        to the caller (the Tier contract in ``kvstore.tiers.base``).
        """
        self._check_open()
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        offset = entry.slot.offset
        view = self._arena.view[offset : offset + entry.length]
        try:
            if not verify:
                page = parse_page(view, expected_key=key)
            elif entry.length >= THREAD_VERIFY_BYTES:
                page = await asyncio.to_thread(decode_page, view, key)
            else:
                page = decode_page(view, expected_key=key)
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
        """``(offset, length)`` of the page of ``key`` in the arena file, or None.

        Offsets are multiples of 4096, so a reader can mmap exactly the page.
        """
        entry = self._entries.get(key)
        return None if entry is None else (entry.slot.offset, entry.length)

    # Zero-copy writers (the store's reservations): a slot is handed out, a client on the same
    # host writes an encoded page into the mapped arena, then the store verifies and publishes it.

    async def allocate_slot(self, nbytes: int) -> Slot | None:
        """A free slot of at least ``nbytes`` that no key owns yet; None when there is no room."""
        self._check_open()
        slot = self._alloc.allocate(nbytes) or await self._allocate_slow(nbytes)
        if slot is None:
            self._stats.rejected += 1
        return slot

    def slot_view(self, slot: Slot) -> memoryview:
        """The whole slot in the arena (writable)."""
        return self._arena.view[slot.offset : slot.offset + slot.slot_bytes]

    def publish(self, slot: Slot, key: BlockKey, meta: PageMeta) -> int:
        """Make the page a writer put into ``slot`` readable as ``key``; return its length.

        The caller has verified the page (``decode_page``); from here the slot belongs to key.
        """
        self._check_open()
        if key in self._entries:  # stored meanwhile by a plain write: keep that copy
            self._alloc.release(slot)
            return self._entries[key].length
        length = page_length(self.slot_view(slot))
        self._entries[key] = _Entry(slot, length, meta)
        self._stats.bytes_written += length
        return length

    def abort(self, slot: Slot) -> None:
        """Give back a slot that was never published."""
        self._alloc.release(slot)

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(
            name=self.name, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
            num_blocks=len(self._entries), hits=s.hits, misses=s.misses,
            corrupt=s.corrupt, rejected=s.rejected, bytes_read=s.bytes_read,
            bytes_written=s.bytes_written,
            extra={
                "arena_bytes": self._arena.size_bytes,
                "slot_classes": self._alloc.num_classes,
                "free_slots": self._alloc.num_free_slots,
            },
        )

    async def pin_cuda(self) -> bool:
        """Register the arena as pinned host memory (cudaHostRegister), now and as it grows.

        Costs about 0.5 s per GiB registered (DESIGN.md), paid in a thread: now for the part
        already grown, later inside each growth step. Returns False, doing nothing, without CUDA.
        """
        self._check_open()
        if not torch.cuda.is_available():
            return False
        async with self._grow_lock:
            if not self._pin_cuda and self._arena.size_bytes:
                await asyncio.to_thread(self._register, 0, self._arena.size_bytes)
            self._pin_cuda = True
            self._alloc.merge_growth = False  # later growth steps are registrations of their own
        return True

    # --- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._is_open:
            raise Unavailable("dram tier is not open (call open() first, or it was closed)")

    async def _store(self, key: BlockKey, view: memoryview, meta: PageMeta) -> bool:
        slot = self._alloc.allocate(view.nbytes) or await self._allocate_slow(view.nbytes)
        if slot is None:
            self._stats.rejected += 1
            return False
        await self._copy_in(slot, view)
        self._entries[key] = _Entry(slot, view.nbytes, meta)
        self._stats.bytes_written += view.nbytes
        self._grow_ahead()
        return True

    async def _allocate_slow(self, nbytes: int) -> Slot | None:
        # Growth happens under the lock only, so a plan made under it cannot go stale.
        async with self._grow_lock:
            while self._is_open:
                slot = self._alloc.allocate(nbytes)
                if slot is not None:
                    return slot
                need = self._alloc.plan_growth(nbytes)
                if not need or not await self._grow_locked(need):
                    return None
        return None

    async def _copy_in(self, slot: Slot, view: memoryview) -> None:
        """Copy a page into its slot; on failure the slot goes back once nothing writes to it."""
        offset, nbytes = slot.offset, view.nbytes
        if nbytes < THREAD_COPY_BYTES:
            self._arena.view[offset : offset + nbytes] = view
            return
        dst = self._arena.view[offset : offset + nbytes]
        copy = asyncio.get_running_loop().run_in_executor(self._copier, _copy_large, dst, view)
        try:
            await asyncio.shield(copy)
        except BaseException:
            # A cancelled wait leaves the thread writing: reuse the slot only after it ends.
            copy.add_done_callback(lambda _: self._alloc.release(slot))
            raise

    def _grow_ahead(self) -> None:
        idle = self._grow_task is None or self._grow_task.done()
        if idle and not self._grow_lock.locked() and self._alloc.spare_growth():
            self._grow_task = asyncio.get_running_loop().create_task(self._spare())

    async def _spare(self) -> None:
        async with self._grow_lock:
            need = self._alloc.spare_growth()
            if need and self._is_open:
                await self._grow_locked(need)

    async def _grow_locked(self, nbytes: int) -> bool:
        """Grow the arena by ``nbytes`` in a thread; False if shared memory ran out."""
        try:
            offset = await asyncio.to_thread(self._grow_blocking, nbytes)
        except CapacityError as exc:
            log.warning("dram: cannot grow the arena: %s", exc)
            return False
        self._alloc.add_grown(offset, nbytes)
        return True

    def _grow_blocking(self, nbytes: int) -> int:
        offset = self._arena.grow(nbytes)
        if self._pin_cuda:
            try:
                self._register(offset, nbytes)
            except CapacityError as exc:  # the bytes stay usable, only DMA from them is slower
                log.warning("dram: arena growth at %d stays pageable: %s", offset, exc)
        return offset

    def _register(self, offset: int, nbytes: int) -> None:
        address = self._arena.base_address() + offset
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_FLAGS))
        if err != 0:
            raise CapacityError(f"cudaHostRegister of {nbytes} arena bytes failed (cudaError {err})")
        self._pinned.append(address)

    def _unpin(self) -> None:
        for address in self._pinned:
            err = int(torch.cuda.cudart().cudaHostUnregister(address))
            if err != 0:
                log.warning("dram: cudaHostUnregister failed (cudaError %d)", err)
        self._pinned.clear()

    def _remove(self, key: BlockKey) -> None:
        self._alloc.release(self._entries.pop(key).slot)
