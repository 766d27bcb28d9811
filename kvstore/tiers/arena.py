"""The DRAM tier's memory: a shared-memory arena file and the slab allocator that carves it."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import CapacityError

PAGE_ALIGN = 4096  # slot sizes, chunk offsets and growth steps are multiples of this
# madvise(MADV_POPULATE_WRITE) prefaults writable pages (Linux 5.14+); Python 3.11's mmap module
# does not name the constant, so it is given by number.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    # mmap.madvise holds the GIL through the whole call (measured: a 90 ms stall of the event
    # loop populating 256 MiB); a ctypes call releases it.
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


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


class SlabAllocator:
    """Size classes of fixed slots over chunks of one growing arena; book-keeping only, no I/O.

    A page of ``n`` bytes takes one slot of its class, ``round_up(n, 4096)``. A class owns
    whole chunks (``chunk_bytes``, trimmed to a multiple of the slot; a page larger than
    ``chunk_bytes`` gets a chunk of its own size). A chunk whose slots are all free goes back to
    the pool of free regions, where adjacent regions merge, so any class can reuse the space.
    ``grown_bytes`` (the arena's file size) never exceeds ``capacity_bytes``.
    Not thread-safe: the tier calls it from its event loop only.
    """

    def __init__(self, capacity_bytes: int, chunk_bytes: int) -> None:
        self.capacity_bytes = round_down(capacity_bytes)
        self.chunk_bytes = max(round_down(chunk_bytes), PAGE_ALIGN)
        self.grown_bytes = 0
        self.used_bytes = 0  # slot bytes of pages in use
        self.num_free_slots = 0  # free slots in chunks assigned to a class
        # Cleared once the arena is pinned: every later growth step is registered on its own and
        # a DMA may not span two registrations, so no chunk may straddle a growth boundary.
        self.merge_growth = True
        self._barriers: set[int] = set()  # offsets free regions never merge across
        self._classes: dict[int, _SizeClass] = {}
        self._regions: dict[int, int] = {}  # free, prefaulted regions: offset -> size
        self._region_ends: dict[int, int] = {}  # end -> offset, to merge neighbours in O(1)

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

    def plan_growth(self, nbytes: int) -> int | None:
        """Bytes the arena must grow for a page of ``nbytes`` to fit: 0 if it fits now, None if
        it cannot fit within capacity without deleting pages."""
        slot_bytes = self.slot_bytes_for(nbytes)
        cls = self._classes.get(slot_bytes)
        if (cls and cls.partial) or self._largest_region() >= slot_bytes:
            return 0
        tail = self._tail_region() if self.merge_growth else 0
        room = self.capacity_bytes - self.grown_bytes
        if tail + room < slot_bytes:
            return None
        # tail < slot_bytes here, and tail + room >= slot_bytes, so this is enough for a slot.
        return min(self._chunk_size(slot_bytes) - tail, room)

    def spare_growth(self) -> int:
        """Bytes to grow ahead so one whole free chunk is ready (0 if one is, or no room)."""
        if self._largest_region() >= self.chunk_bytes:
            return 0
        room = self.capacity_bytes - self.grown_bytes
        tail = self._tail_region() if self.merge_growth else 0
        return min(self.chunk_bytes - tail, room)

    def add_grown(self, offset: int, nbytes: int) -> None:
        """Record that the arena grew by ``nbytes`` at ``offset`` (its old end)."""
        if offset != self.grown_bytes or offset + nbytes > self.capacity_bytes:
            raise CapacityError(
                f"arena growth at {offset}+{nbytes} does not extend {self.grown_bytes} within "
                f"capacity {self.capacity_bytes}"
            )
        self.grown_bytes += nbytes
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
            merged += self.capacity_bytes - self.grown_bytes
        return merged >= slot_bytes

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
    """One file in shared memory, mapped MAP_SHARED once for its whole capacity.

    The mapping reserves ``capacity_bytes`` of address space up front so it never moves (views
    handed to readers stay valid) while the file itself grows in steps: ``grow`` extends the
    file, allocates its pages and prefaults them. Bytes past the file's end are never touched.
    Other processes map the file by path and read pages at offsets the tier reports.
    """

    def __init__(self, path: str, capacity_bytes: int) -> None:
        self.path = path
        self.capacity_bytes = round_down(capacity_bytes)
        self.size_bytes = 0
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self._base = 0
        self.view = memoryview(b"")

    def create(self) -> None:
        """Create the file (replacing a stale one of the same name) and reserve the mapping."""
        # A file of this name was left by a crashed process with our pid; nobody maps it now.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        # The owner holds a lock on its arena for as long as it lives; a file nobody locks was
        # left by a dead process (reclaim_stale_arenas). flock works across pid namespaces.
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if self.capacity_bytes == 0:
            return
        # mmap refuses a length beyond the file's size, so size the file for the call only.
        os.ftruncate(self._fd, self.capacity_bytes)
        try:
            self._mmap = mmap.mmap(self._fd, self.capacity_bytes, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.ftruncate(self._fd, 0)
        self.view = memoryview(self._mmap)
        probe = np.frombuffer(self._mmap, dtype=np.uint8, count=1)
        self._base = probe.ctypes.data
        del probe  # drops the buffer export so the mapping can still be closed

    def grow(self, nbytes: int) -> int:
        """Extend the file by ``nbytes`` and prefault the new pages; return the old end.

        Blocking (about 0.4 GB/s on tmpfs, the kernel zeroes every page): call it in a thread.
        Raises CapacityError when the file system (tmpfs) has no room left.
        """
        offset = self.size_bytes
        if nbytes <= 0 or offset + nbytes > self.capacity_bytes or nbytes % PAGE_ALIGN:
            raise CapacityError(f"cannot grow arena {self.path} by {nbytes} bytes at {offset}")
        os.ftruncate(self._fd, offset + nbytes)
        try:
            # Reserve the pages now: touching a page tmpfs cannot back would raise SIGBUS.
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as exc:
            os.ftruncate(self._fd, offset)
            raise CapacityError(
                f"shared memory for arena {self.path} is exhausted: {os.strerror(exc.errno)}"
            ) from None
        self._prefault(offset, nbytes)
        self.size_bytes = offset + nbytes
        return offset

    def base_address(self) -> int:
        """Virtual address of the mapping's first byte in this process (0 if none)."""
        return self._base

    def close(self) -> None:
        """Unmap (if no view is still held), close and unlink the file."""
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _prefault(self, offset: int, nbytes: int) -> None:
        # First writes into fresh tmpfs pages fault at ~0.5 GB/s against ~13 GB/s once mapped;
        # pay that here, off the request path.
        if _MADVISE is not None:
            if _MADVISE(self._base + offset, nbytes, MADV_POPULATE_WRITE) == 0:
                return
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE) on {self.path}: "
                                   f"{os.strerror(err)}")
        pages = np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes, offset=offset)
        pages[::mmap.PAGESIZE] = 0  # one write per page maps it; the new pages are zero anyway
        del pages


STALE_MIN_AGE_S = 5.0  # between creating an arena file and locking it there is a brief window


def reclaim_stale_arenas(directory: str, pattern: str = "kvstore-dram-*.arena") -> list[str]:
    """Unlink arena files in ``directory`` whose owner is gone (nobody holds their lock).

    A daemon killed with SIGKILL cannot unlink its arena; without this, every crash would leak
    its shared memory until reboot. Returns the paths removed.
    """
    removed = []
    for path in glob.glob(os.path.join(directory, pattern)):
        try:
            if time.time() - os.stat(path).st_mtime < STALE_MIN_AGE_S:
                continue  # just created: its owner may not hold the lock yet
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live owner holds it
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
