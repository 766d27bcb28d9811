"""The DRAM tier's memory, within a growth budget every tenant's memory shares: staging arenas
(one writable memfd per tenant, carved by a slab allocator) and published memory (one sealed
memfd per growth step, ``SealedStep``, carved into one size class by a ``StepPool``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import CapacityError, Unavailable
from kvstore.madvise import MADV_POPULATE_WRITE, MADV_REMOVE, MADVISE
from kvstore.page import (
    F_SEAL_FUTURE_WRITE,
    PUBLISHED_HEADER_BYTES,
    PUBLISHED_LIVE,
    PUBLISHED_MAGIC,
    PUBLISHED_RETIRED,
    PUBLISHED_STATE_OFFSET,
)

PAGE_ALIGN = 4096  # slot sizes, chunk offsets and growth steps are multiples of this
# An arena's file never changes size, and nobody can add a seal after these: a client holding
# the descriptor can neither shrink it under the daemon's mapping (which would SIGBUS the
# daemon on its next touch) nor seal it against the daemon's own writes.
_ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# F_SEAL_FUTURE_WRITE (Linux 5.1+): added after the owner mapped a memfd
# writable, it refuses every later way to write it (write, pwrite, a new writable mapping,
# mprotect to writable, a writable reopen through /proc) while the owner's mapping keeps
# writing; it also refuses freeing its memory (MADV_REMOVE, hole punching): a sealed memfd
# goes back whole, when its last descriptor and mapping close.
_STEP_SEALS = _ARENA_SEALS | F_SEAL_FUTURE_WRITE


def round_up(nbytes: int, align: int = PAGE_ALIGN) -> int:
    return -(-nbytes // align) * align


def round_down(nbytes: int, align: int = PAGE_ALIGN) -> int:
    return nbytes // align * align


@dataclass(slots=True, eq=False)
class Chunk:
    """A run of the arena cut into ``num_slots`` slots of ``slot_bytes`` for one size class."""

    offset: int
    size: int
    slot_bytes: int
    num_slots: int
    num_used: int = 0
    next_unused: int = 0  # slots from here on were never handed out (no free list to build)
    free: list[int] = field(default_factory=list)  # indices handed back

    def take(self) -> int:
        self.num_used += 1
        if self.free:
            return self.free.pop()
        self.next_unused += 1
        return self.next_unused - 1

    def give(self, index: int) -> None:
        self.num_used -= 1
        self.free.append(index)


@dataclass(frozen=True, slots=True)
class Slot:
    """One slot: where a single page lives in the arena."""

    chunk: Chunk
    index: int

    @property
    def offset(self) -> int:
        return self.chunk.offset + self.index * self.chunk.slot_bytes

    @property
    def slot_bytes(self) -> int:
        return self.chunk.slot_bytes


@dataclass(slots=True)
class _SizeClass:
    slot_bytes: int
    chunks: dict[int, Chunk] = field(default_factory=dict)  # offset -> chunk
    partial: dict[int, Chunk] = field(default_factory=dict)  # chunks with a free slot


class GrowthBudget:
    """Bytes that several arenas may grow by in total: one tier's capacity, shared by the
    allocators of its arenas (one per tenant). Not thread-safe, like the allocators."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = round_down(capacity_bytes)
        self.grown_bytes = 0  # memory every arena sharing the budget has grown, together

    @property
    def room_bytes(self) -> int:
        return self.capacity_bytes - self.grown_bytes


class SlabAllocator:
    """Size classes of fixed slots over chunks of one growing arena; book-keeping only, no I/O.

    A page of ``n`` bytes takes one slot of its class, ``round_up(n, 4096)``. A class owns
    whole chunks (``chunk_bytes``, trimmed to a multiple of the slot; a page larger than
    ``chunk_bytes`` gets a chunk of its own size). A chunk whose slots are all free goes back to
    the pool of free regions, where adjacent regions merge, so any class can reuse the space.
    ``grown_bytes`` (the arena's extent) never exceeds ``capacity_bytes``; ``backed_bytes`` is
    the memory inside it, which with a shared ``budget`` the arenas drawing on it never take
    past its capacity together. ``release_free`` gives free regions anywhere in the arena back
    to the budget (the tail shrinks the extent; a region inside it becomes a hole, which later
    growth backs again first), so memory moves between arenas chunk by chunk. Not
    thread-safe: the tier calls it from its event loop only.
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int,
                 budget: GrowthBudget | None = None) -> None:
        self.capacity_bytes = round_down(capacity_bytes)
        self.chunk_bytes = max(round_down(chunk_bytes), PAGE_ALIGN)
        self.grown_bytes = 0
        self._budget = budget or GrowthBudget(self.capacity_bytes)
        self.used_bytes = 0  # slot bytes of pages in use
        self.num_free_slots = 0  # free slots in chunks assigned to a class
        # Cleared once the arena is pinned: every later growth step is registered on its own and
        # a DMA may not span two registrations, so no chunk may straddle a growth boundary.
        self.merge_growth = True
        self._barriers: set[int] = set()  # offsets free regions never merge across
        self._classes: dict[int, _SizeClass] = {}
        self._regions: dict[int, int] = {}  # free, prefaulted regions: offset -> size
        self._region_ends: dict[int, int] = {}  # end -> offset, to merge neighbours in O(1)
        self._holes: dict[int, int] = {}  # released ranges inside the extent: offset -> size

    @staticmethod
    def slot_bytes_for(nbytes: int) -> int:
        """The slot size (size class) a page of ``nbytes`` takes."""
        return round_up(max(nbytes, 1))

    @property
    def num_classes(self) -> int:
        return len(self._classes)

    @property
    def free_region_bytes(self) -> int:
        return sum(self._regions.values())

    @property
    def backed_bytes(self) -> int:
        """Memory inside the extent (the extent less its holes): what the budget is charged."""
        return self.grown_bytes - sum(self._holes.values())

    @property
    def releasable_bytes(self) -> int:
        """Free bytes ``release_free`` could give back (none once the arena is pinned: a
        registered range is never cut)."""
        return self.free_region_bytes if self.merge_growth else 0

    def release_free(self, nbytes: int) -> list[tuple[int, int]]:
        """Give free regions back to the budget, largest first, until at least ``nbytes`` went
        back (or none is left); return each ``(offset, size)`` given (release that memory)."""
        released: list[tuple[int, int]] = []
        total = 0
        while self.merge_growth and total < nbytes and self._regions:
            size, offset = max((size, offset) for offset, size in self._regions.items())
            self._remove_region(offset)
            self._budget.grown_bytes -= size
            released.append((offset, size))
            total += size
            if offset + size == self.grown_bytes:
                self.grown_bytes = offset
                before = self._holes_ending_at(offset)
                if before is not None:  # a hole now ends the extent: drop it with the tail
                    del self._holes[before]
                    self.grown_bytes = before
            else:
                self._add_hole(offset, size)
        return released

    def allocate(self, nbytes: int) -> Slot | None:
        """A slot for a page of ``nbytes`` from the grown arena, or None (grow or evict first)."""
        slot_bytes = self.slot_bytes_for(nbytes)
        cls = self._classes.get(slot_bytes)
        chunk = next(iter(cls.partial.values())) if cls and cls.partial else None
        if chunk is None:
            chunk = self._assign_chunk(slot_bytes)
            if chunk is None:
                return None
            cls = self._classes[slot_bytes]
        index = chunk.take()
        if chunk.num_used == chunk.num_slots:
            del cls.partial[chunk.offset]
        self.used_bytes += slot_bytes
        self.num_free_slots -= 1
        return Slot(chunk, index)

    def release(self, slot: Slot) -> None:
        """Hand a slot back; a chunk left empty returns to the free pool."""
        chunk = slot.chunk
        chunk.give(slot.index)
        self.used_bytes -= chunk.slot_bytes
        self.num_free_slots += 1
        cls = self._classes[chunk.slot_bytes]
        if chunk.num_used == 0:
            self._retire(cls, chunk)
        else:
            cls.partial[chunk.offset] = chunk

    def fits(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits in the grown arena now (no growth)."""
        slot_bytes = self.slot_bytes_for(nbytes)
        cls = self._classes.get(slot_bytes)
        return bool(cls and cls.partial) or self._largest_region() >= slot_bytes

    def plan_growth(self, nbytes: int) -> int | None:
        """Bytes the arena must grow for a page of ``nbytes`` to fit: 0 if it fits now, None if
        it cannot fit within capacity without deleting pages."""
        plan = self.growth_plan(nbytes)
        return None if plan is None else plan[1]

    def growth_plan(self, nbytes: int) -> tuple[int, int] | None:
        """Where and how much to grow for a page of ``nbytes``: ``(offset, nbytes)`` (``nbytes``
        0 if it fits now), or None if it cannot fit without deleting pages. A hole is backed
        again before the extent grows."""
        slot_bytes = self.slot_bytes_for(nbytes)
        if self.fits(nbytes):
            return self.grown_bytes, 0
        hole = min(((size, off) for off, size in self._holes.items() if size >= slot_bytes),
                   default=None)
        if hole is not None and self._budget.room_bytes >= slot_bytes:
            size, offset = hole
            return offset, min(self._chunk_size(slot_bytes), size, self._budget.room_bytes)
        grow = self._tail_growth(slot_bytes)
        return None if grow is None else (self.grown_bytes, grow)

    def _tail_growth(self, slot_bytes: int) -> int | None:
        tail = self._tail_region() if self.merge_growth else 0
        room = self._room()
        if tail + room < slot_bytes:
            return None
        # tail < slot_bytes here, and tail + room >= slot_bytes, so this is enough for a slot.
        return min(self._chunk_size(slot_bytes) - tail, room)

    def spare_growth(self) -> int:
        """Bytes to grow ahead so one whole free chunk is ready (0 if one is, or no room)."""
        return self.spare_plan()[1]

    def spare_plan(self) -> tuple[int, int]:
        """``(offset, nbytes)`` to grow ahead so one whole free chunk is ready (``nbytes`` 0 if
        one is, or there is no room)."""
        if self._largest_region() >= self.chunk_bytes:
            return self.grown_bytes, 0
        hole = max(((size, off) for off, size in self._holes.items()), default=None)
        if hole is not None:
            size, offset = hole
            return offset, min(self.chunk_bytes, size, self._budget.room_bytes)
        room = self._room()
        tail = self._tail_region() if self.merge_growth else 0
        return self.grown_bytes, max(0, min(self.chunk_bytes - tail, room))

    def add_grown(self, offset: int, nbytes: int) -> None:
        """Record that the arena grew by ``nbytes`` at ``offset`` (its old end, or inside a
        hole ``release_free`` left)."""
        hole = self._hole_at(offset, nbytes)
        if hole is not None and nbytes <= self._budget.room_bytes:
            start, size = hole
            del self._holes[start]
            if offset > start:
                self._holes[start] = offset - start
            if offset + nbytes < start + size:
                self._holes[offset + nbytes] = start + size - offset - nbytes
        elif offset == self.grown_bytes and nbytes <= self._room():
            self.grown_bytes += nbytes
        else:
            raise CapacityError(
                f"arena growth at {offset}+{nbytes} neither extends {self.grown_bytes} nor "
                f"fills a released range within capacity {self.capacity_bytes} (shared budget: "
                f"{self._budget.room_bytes} bytes left)"
            )
        self._budget.grown_bytes += nbytes
        if not self.merge_growth:
            self._barriers.add(offset)
        self._add_region(offset, nbytes)

    def frees_room(self, slot: Slot, nbytes: int) -> bool:
        """Whether releasing ``slot`` alone would let a page of ``nbytes`` fit."""
        slot_bytes = self.slot_bytes_for(nbytes)
        if slot.slot_bytes == slot_bytes or self.plan_growth(nbytes) is not None:
            return True
        chunk = slot.chunk
        if chunk.num_used != 1:
            return False
        start, end, merged = chunk.offset, chunk.offset + chunk.size, chunk.size
        before = self._region_ends.get(start)
        if before is not None and start not in self._barriers:
            merged += start - before
        after = self._regions.get(end)
        if after is not None and end not in self._barriers:
            merged, end = merged + after, end + after
        if end == self.grown_bytes and self.merge_growth:
            merged += self._room()
        return merged >= slot_bytes

    def backed_ranges(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` of each run of memory inside the extent, between its holes."""
        ranges, start = [], 0
        for offset, size in sorted(self._holes.items()):
            if offset > start:
                ranges.append((start, offset - start))
            start = offset + size
        if self.grown_bytes > start:
            ranges.append((start, self.grown_bytes - start))
        return ranges

    def chunk_of(self, slot: Slot) -> int:
        """The offset of the chunk ``slot`` is in (chunks free whole, back into the arena)."""
        return slot.chunk.offset

    def _hole_at(self, offset: int, nbytes: int) -> tuple[int, int] | None:
        for start, size in self._holes.items():
            if start <= offset and offset + nbytes <= start + size:
                return start, size
        return None

    def _holes_ending_at(self, end: int) -> int | None:
        return next((start for start, size in self._holes.items() if start + size == end), None)

    def _add_hole(self, offset: int, size: int) -> None:
        after = self._holes.pop(offset + size, None)
        if after is not None:
            size += after
        before = self._holes_ending_at(offset)
        if before is not None:
            size += self._holes.pop(before)
            offset = before
        self._holes[offset] = size

    def _room(self) -> int:
        """Bytes this arena may still grow by: its own bound and the shared budget's."""
        return min(self.capacity_bytes - self.grown_bytes, self._budget.room_bytes)

    def _chunk_size(self, slot_bytes: int) -> int:
        if slot_bytes >= self.chunk_bytes:
            return slot_bytes
        return self.chunk_bytes // slot_bytes * slot_bytes

    def _assign_chunk(self, slot_bytes: int) -> Chunk | None:
        # Best fit among free regions; else the largest one that holds at least one slot.
        want = self._chunk_size(slot_bytes)
        fits = [(size, off) for off, size in self._regions.items() if size >= want]
        if fits:
            size, offset = min(fits)
        else:
            size, offset = max(((s, o) for o, s in self._regions.items()), default=(0, 0))
            if size < slot_bytes:
                return None
        chunk_size = min(want, size // slot_bytes * slot_bytes)
        self._remove_region(offset)
        if size > chunk_size:
            self._add_region(offset + chunk_size, size - chunk_size)
        chunk = Chunk(offset, chunk_size, slot_bytes, chunk_size // slot_bytes)
        cls = self._classes.setdefault(slot_bytes, _SizeClass(slot_bytes))
        cls.chunks[offset] = chunk
        cls.partial[offset] = chunk
        self.num_free_slots += chunk.num_slots
        return chunk

    def _retire(self, cls: _SizeClass, chunk: Chunk) -> None:
        del cls.chunks[chunk.offset]
        cls.partial.pop(chunk.offset, None)
        if not cls.chunks:
            del self._classes[cls.slot_bytes]
        self.num_free_slots -= chunk.num_slots
        self._add_region(chunk.offset, chunk.size)

    def _add_region(self, offset: int, size: int) -> None:
        end = offset + size
        after = self._regions.get(end)
        if after is not None and end not in self._barriers:
            self._remove_region(end)
            size += after
        before = self._region_ends.get(offset)
        if before is not None and offset not in self._barriers:
            size += self._remove_region(before)
            offset = before
        self._regions[offset] = size
        self._region_ends[offset + size] = offset

    def _remove_region(self, offset: int) -> int:
        size = self._regions.pop(offset)
        del self._region_ends[offset + size]
        return size

    def _largest_region(self) -> int:
        return max(self._regions.values(), default=0)

    def _tail_region(self) -> int:
        start = self._region_ends.get(self.grown_bytes)
        return self.grown_bytes - start if start is not None else 0


class ShmArena:
    """One memfd (anonymous shared memory, no path in any file system), mapped MAP_SHARED once.

    The file is sized to ``capacity_bytes`` at creation and sealed at that size
    (``_ARENA_SEALS``); memory backs it only where ``grow`` allocated and prefaulted it, and
    ``shrink`` gives the end back. The mapping never moves, so views handed to readers stay
    valid. Other processes map it only through a descriptor the owner hands them (the daemon's
    descriptor channel, ``kvstore.server.fdpass``): a memfd has no name anyone can open, and
    it goes away with the last descriptor and mapping, so a crashed owner leaks nothing.
    """

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.name = name
        self.capacity_bytes = round_down(capacity_bytes)
        self.size_bytes = 0  # bytes from the start backed by memory (grown)
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self._base = 0
        self.view = memoryview(b"")

    @property
    def fd(self) -> int:
        """The memfd (owned by this arena: duplicate it to keep it past ``close``)."""
        return self._fd

    def create(self) -> None:
        """Create and seal the memfd and map all of it (address space only: nothing is
        allocated until ``grow``)."""
        if not hasattr(os, "memfd_create"):
            raise CapacityError("the DRAM tier needs memfd_create (Linux 3.17 or later)")
        self._fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            if self.capacity_bytes:
                os.ftruncate(self._fd, self.capacity_bytes)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _ARENA_SEALS)
            if self.capacity_bytes == 0:
                return
            self._mmap = mmap.mmap(self._fd, self.capacity_bytes, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        self.view = memoryview(self._mmap)
        probe = np.frombuffer(self._mmap, dtype=np.uint8, count=1)
        self._base = probe.ctypes.data
        del probe  # drops the buffer export so the mapping can still be closed

    def grow(self, nbytes: int, offset: int | None = None) -> int:
        """Allocate and prefault ``nbytes`` at ``offset`` (default: after the grown part, which
        then extends; else inside it, where ``release`` freed memory); return the offset.

        Blocking (about 0.4 GB/s, the kernel zeroes every page): call it in a thread.
        Raises CapacityError when the kernel has no memory to back them.
        """
        offset = self.size_bytes if offset is None else offset
        if (nbytes <= 0 or offset + nbytes > self.capacity_bytes or nbytes % PAGE_ALIGN
                or offset % PAGE_ALIGN or offset > self.size_bytes):
            raise CapacityError(f"cannot grow arena {self.name} by {nbytes} bytes at {offset}")
        try:
            # Reserve the pages now: touching a page shmem cannot back would raise SIGBUS.
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as exc:
            self._release(offset, nbytes)
            raise CapacityError(
                f"shared memory for arena {self.name} is exhausted: {os.strerror(exc.errno)}"
            ) from None
        self._prefault(offset, nbytes)
        self.size_bytes = max(self.size_bytes, offset + nbytes)
        return offset

    def release(self, offset: int, nbytes: int) -> None:
        """Free the memory of ``nbytes`` at ``offset`` (nothing there may be in use); the end
        of the grown part moves back if they reach it. Blocking: call it in a thread."""
        if offset < 0 or offset % PAGE_ALIGN or nbytes % PAGE_ALIGN or offset + nbytes > \
                self.size_bytes:
            raise CapacityError(f"cannot release {nbytes} bytes at {offset} of arena {self.name}")
        self._release(offset, nbytes)
        if offset + nbytes == self.size_bytes:
            self.size_bytes = offset

    def shrink(self, offset: int) -> None:
        """Free the memory from ``offset`` to the grown end (nothing there may be in use).

        Blocking (the kernel frees every page): call it in a thread.
        """
        if not 0 <= offset <= self.size_bytes or offset % PAGE_ALIGN:
            raise CapacityError(f"cannot shrink arena {self.name} to {offset} bytes")
        self._release(offset, self.size_bytes - offset)
        self.size_bytes = offset

    def base_address(self) -> int:
        """Virtual address of the mapping's first byte in this process (0 if none)."""
        return self._base

    def close(self) -> None:
        """Unmap (if no view is still held) and close the memfd; its memory goes with the
        last mapping of it, here or in a client."""
        self.view.release()  # slices handed out keep the mapping alive on their own
        self.view = memoryview(b"")
        if self._mmap is not None:
            # A reader still holding a page view keeps the mapping alive until its last view
            # goes (mmap refuses to close under exported buffers); nothing else is lost.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
            self._base = 0
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _release(self, offset: int, nbytes: int) -> None:
        if nbytes <= 0 or MADVISE is None or not self._base:
            return
        if MADVISE(self._base + offset, nbytes, MADV_REMOVE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_REMOVE) on arena {self.name}: {os.strerror(err)}")

    def _prefault(self, offset: int, nbytes: int) -> None:
        _prefault(self._mmap, self._base, offset, nbytes, self.name)


def _prefault(mapped: mmap.mmap, base: int, offset: int, nbytes: int, name: str) -> None:
    # First writes into fresh shmem pages fault at ~0.5 GB/s against ~13 GB/s once mapped;
    # pay that here, off the request path.
    if MADVISE is not None:
        if MADVISE(base + offset, nbytes, MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) on {name}: {os.strerror(err)}")
    pages = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=offset)
    pages[::mmap.PAGESIZE] = 0  # one write per page maps it; the new pages are zero anyway
    del pages


class SealedStep:
    """One growth step of published memory: a memfd of its own, backed and mapped writable here,
    then sealed (``_STEP_SEALS``) so that nobody else can ever write it, resize it or free part
    of it. Its first page is the header clients read (``kvstore.page.is_retired``); slots
    follow. It goes back whole: ``retire`` marks the header, unmaps and closes it, and the
    memory is freed once the last client mapping of it is gone too.
    """

    def __init__(self, name: str, nbytes: int) -> None:
        if nbytes <= PUBLISHED_HEADER_BYTES or nbytes % PAGE_ALIGN:
            raise CapacityError(f"a published step of {nbytes} bytes holds no slot")
        self.name = name
        self.nbytes = nbytes
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self._base = 0
        self.view = memoryview(b"")

    @property
    def fd(self) -> int:
        """The memfd (owned by this step: duplicate it to keep it past ``retire``)."""
        return self._fd

    def base_address(self) -> int:
        return self._base

    def create(self) -> None:
        """Make, back, prefault, map and seal the memfd. Blocking (about 0.4 GB/s, the kernel
        zeroes every page): call it in a thread. CapacityError when shared memory is exhausted,
        Unavailable when the kernel cannot seal it against future writes (before Linux 5.1)."""
        self._fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, self.nbytes)
            try:
                os.posix_fallocate(self._fd, 0, self.nbytes)  # touching unbacked pages: SIGBUS
            except OSError as exc:
                raise CapacityError(f"shared memory for {self.name} is exhausted: "
                                    f"{os.strerror(exc.errno)}") from None
            self._mmap = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            probe = np.frombuffer(self._mmap, dtype=np.uint8, count=1)
            self._base = probe.ctypes.data
            del probe
            _prefault(self._mmap, self._base, 0, self.nbytes, self.name)
            self._mmap[:PUBLISHED_STATE_OFFSET + 1] = PUBLISHED_MAGIC + bytes([PUBLISHED_LIVE])
            try:
                fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _STEP_SEALS)
            except OSError as exc:
                raise Unavailable(f"the DRAM tier needs F_SEAL_FUTURE_WRITE (Linux 5.1 or "
                                  f"later) to publish pages: {os.strerror(exc.errno)}") from None
        except BaseException:
            self.retire()
            raise
        self.view = memoryview(self._mmap)

    def retire(self) -> None:
        """Mark the step given back (clients holding a mapping see it and drop theirs), unmap
        it (once no view of it is held here) and close the memfd. Blocking: call it in a
        thread."""
        self.view.release()
        self.view = memoryview(b"")
        if self._mmap is not None:
            self._mmap[PUBLISHED_STATE_OFFSET] = PUBLISHED_RETIRED
            with contextlib.suppress(BufferError):  # a reader's page view: goes with the last
                self._mmap.close()
            self._mmap = None
            self._base = 0
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(slots=True, eq=False)
class Step:
    """A step of one tenant's published memory: its region name, its memory and how it is
    cut (``chunk``: slots of one size class after the header page; None while empty)."""

    region: str
    memory: SealedStep
    chunk: Chunk | None = None
    fetchers: set[int] = field(default_factory=set)  # client pids its descriptor went to

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    @property
    def slots_bytes(self) -> int:
        return self.memory.nbytes - PUBLISHED_HEADER_BYTES


class StepPool:
    """The steps of one tenant's published memory and their slots; book-keeping only, no I/O.

    A step is cut for one size class when a page first needs it; a step whose slots are all
    free stays backed and is cut again for whichever class needs it next, until it is given
    back whole (``take_empty``): steps are the unit of memory published memory gives back.
    Not thread-safe: the tier calls it from its event loop only.
    """

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = max(round_down(chunk_bytes), PAGE_ALIGN)
        self.steps: dict[str, Step] = {}  # by region
        self.backed_bytes = 0  # every step's bytes
        self.used_bytes = 0  # slot bytes of pages in use
        self._partial: dict[int, dict[str, Step]] = {}  # size class -> steps with a free slot
        self._empty: dict[str, Step] = {}

    @property
    def releasable_bytes(self) -> int:
        """Bytes of steps with no page in them (``take_empty`` gives them back)."""
        return sum(step.nbytes for step in self._empty.values())

    @property
    def num_classes(self) -> int:
        return len({step.chunk.slot_bytes for step in self.steps.values() if step.chunk})

    @property
    def num_free_slots(self) -> int:
        """Free slots in steps cut for a class."""
        return sum(s.chunk.num_slots - s.chunk.num_used for s in self.steps.values() if s.chunk)

    def step_bytes_for(self, nbytes: int, room_bytes: int) -> int | None:
        """Bytes of a new step for pages of ``nbytes`` (a chunk's worth of their slots, fewer
        if only ``room_bytes`` are left), or None if not even one slot fits in the room."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        want = slot_bytes if slot_bytes >= self.chunk_bytes else \
            self.chunk_bytes // slot_bytes * slot_bytes
        room = max(0, room_bytes - PUBLISHED_HEADER_BYTES)
        slots = min(want, room // slot_bytes * slot_bytes)
        return None if slots < slot_bytes else PUBLISHED_HEADER_BYTES + slots

    def fits(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits in a step already made (no growth)."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        return bool(self._partial.get(slot_bytes)) or any(
            step.slots_bytes >= slot_bytes for step in self._empty.values())

    def add(self, step: Step) -> None:
        """A new step (empty, uncut)."""
        self.steps[step.region] = step
        self._empty[step.region] = step
        self.backed_bytes += step.nbytes

    def allocate(self, nbytes: int) -> tuple[Step, Slot] | None:
        """A free slot for a page of ``nbytes``: in a step of its class, else in the smallest
        empty step that holds one (cut for its class now); None if neither exists."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        partial = self._partial.setdefault(slot_bytes, {})
        step = next(iter(partial.values()), None)
        if step is None:
            step = min((s for s in self._empty.values() if s.slots_bytes >= slot_bytes),
                       key=lambda s: s.nbytes, default=None)
            if step is None:
                return None
            del self._empty[step.region]
            num_slots = step.slots_bytes // slot_bytes
            step.chunk = Chunk(PUBLISHED_HEADER_BYTES, num_slots * slot_bytes, slot_bytes,
                               num_slots)
            partial[step.region] = step
        chunk = step.chunk
        index = chunk.take()
        if chunk.num_used == chunk.num_slots:
            del partial[step.region]
        self.used_bytes += slot_bytes
        return step, Slot(chunk, index)

    def release(self, step: Step, slot: Slot) -> None:
        """Hand a slot back; a step left empty waits to be cut again or given back."""
        chunk = step.chunk
        chunk.give(slot.index)
        self.used_bytes -= chunk.slot_bytes
        partial = self._partial[chunk.slot_bytes]
        if chunk.num_used == 0:
            partial.pop(step.region, None)
            step.chunk = None
            self._empty[step.region] = step
        else:
            partial[step.region] = step

    def take_empty(self, nbytes: int) -> list[Step]:
        """Remove empty steps, largest first, until at least ``nbytes`` of them went (or none
        is left); the caller retires them."""
        taken, total = [], 0
        for step in sorted(self._empty.values(), key=lambda s: -s.nbytes):
            if total >= nbytes:
                break
            taken.append(self._drop(step))
            total += step.nbytes
        return taken

    def take_all(self) -> list[Step]:
        """Remove every step (closing the tier)."""
        return [self._drop(step) for step in list(self.steps.values())]

    def _drop(self, step: Step) -> Step:
        del self.steps[step.region]
        self._empty.pop(step.region, None)
        if step.chunk is not None:
            self._partial[step.chunk.slot_bytes].pop(step.region, None)
        self.backed_bytes -= step.nbytes
        return step
