"""The DRAM tier's shared memory: memfds mapped once, a tenant's staging arena (``ShmArena``) and
its published memory (one sealed memfd per growth step, ``SealedStep``, carved into one size
class by a ``StepPool``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
from dataclasses import dataclass

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
from kvstore.tiers.dram.slabs import PAGE_ALIGN, Chunk, SlabAllocator, Slot, round_down

# An arena's file never changes size, and nobody can add a seal after these: a client holding
# the descriptor can neither shrink it under the daemon's mapping (which would SIGBUS the
# daemon on its next touch) nor seal it against the daemon's own writes.
_ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# F_SEAL_FUTURE_WRITE (Linux 5.1+): added after the owner mapped a memfd
# writable, it refuses every later way to write it (write, pwrite, a new writable mapping,
# mprotect to writable, a writable reopen through /proc) while the owner's mapping keeps
# writing. It also refuses freeing part of its memory (MADV_REMOVE, hole punching), but not
# shrinking it: a published step leaves F_SEAL_SHRINK off, so that the tier can cut it down to
# its header page when it gives it back and so free its memory for real, whoever still holds
# a descriptor or mapping of it (issue 28: a client passed its descriptors on to a process the
# daemon could not see, which kept 112 MiB of given-back steps outside the budget). Nobody
# else can shrink it: clients get a read-only description of it (``client_fd``; ftruncate
# needs a writable one), and its mode (``STEP_MODE``) refuses another user a writable reopen.
_STEP_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL | F_SEAL_FUTURE_WRITE
STEP_MODE = 0o400  # a memfd is made 0777: anyone holding it could reopen it writable


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

    @property
    def held_bytes(self) -> int:
        """Memory the memfd holds now, wherever a mapping touched it (the kernel's count of
        its pages; -1 once closed): more than the grown part when a client touched the rest."""
        return os.fstat(self._fd).st_blocks * 512 if self._fd >= 0 else -1

    def punch(self, ranges: list[tuple[int, int]]) -> None:
        """Free the memory of ``(offset, nbytes)`` ranges outside the grown part, which only a
        client touching pages it was not lent can have made the memfd hold (a punched hole
        reads as zeros again; the file keeps its size). Blocking: call it in a thread."""
        for offset, nbytes in ranges:
            self._release(offset, nbytes)

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
    follow. It goes back whole: ``retire`` marks the header, unmaps it and cuts the memfd down
    to that header page, which frees the slots' memory at once whoever else still maps it (a
    client reading past the header of a step given back then gets SIGBUS; a client only reads
    slots its lease pins, and a step goes back only once it holds no page).
    """

    def __init__(self, name: str, nbytes: int) -> None:
        if nbytes <= PUBLISHED_HEADER_BYTES or nbytes % PAGE_ALIGN:
            raise CapacityError(f"a published step of {nbytes} bytes holds no slot")
        self.name = name
        self.nbytes = nbytes
        self._fd = -1
        self._client_fd = -1
        self._mmap: mmap.mmap | None = None
        self._base = 0
        self.view = memoryview(b"")

    @property
    def fd(self) -> int:
        """The memfd (owned by this step: duplicate it to keep it past ``retire``)."""
        return self._fd

    @property
    def client_fd(self) -> int:
        """A read-only description of the memfd, the one clients are sent: with it nobody can
        shrink the step (ftruncate) or add a seal (owned by this step, like ``fd``)."""
        return self._client_fd

    @property
    def held_bytes(self) -> int:
        """Memory the memfd holds now (the kernel's count of its pages; -1 once closed)."""
        return os.fstat(self._fd).st_blocks * 512 if self._fd >= 0 else -1

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
            # A new open file description, read-only (a process may always reopen its own
            # descriptors, non-dumpable or not), before the mode takes write access away.
            self._client_fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
            os.fchmod(self._fd, STEP_MODE)
        except BaseException:
            self.retire(free=False)
            raise
        self.view = memoryview(self._mmap)

    def retire(self, free: bool = True) -> bool:
        """Mark the step given back (clients holding a mapping see it and drop theirs), unmap
        it and, with ``free``, cut the memfd down to its header page (its slots' memory goes
        at once, whoever holds it), then close it. True once done; False (nothing closed,
        call again later) while a view of it is still held in this process: a reader of a
        page deleted meanwhile may still be reading it, and cutting the memory under it would
        kill the daemon with SIGBUS. Without ``free`` (the tier closing, clients may still be
        reading under their leases) the memory goes with the last mapping of it, as a memfd's
        does. Blocking: call it in a thread."""
        self.view.release()
        self.view = memoryview(b"")
        if self._mmap is not None:
            self._mmap[PUBLISHED_STATE_OFFSET] = PUBLISHED_RETIRED
            try:
                self._mmap.close()
            except BufferError:  # a view here still reads it
                if free:
                    return False
            self._mmap = None
            self._base = 0
        if self._fd >= 0:
            if free and os.fstat(self._fd).st_size > PUBLISHED_HEADER_BYTES:
                os.ftruncate(self._fd, PUBLISHED_HEADER_BYTES)
            os.close(self._fd)
            self._fd = -1
        if self._client_fd >= 0:
            os.close(self._client_fd)
            self._client_fd = -1
        return True


@dataclass(slots=True, eq=False)
class Step:
    """A step of one tenant's published memory: its region name, its memory and how it is
    cut (``chunk``: slots of one size class after the header page; None while empty)."""

    region: str
    memory: SealedStep
    chunk: Chunk | None = None

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
