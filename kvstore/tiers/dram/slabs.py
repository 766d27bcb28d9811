"""Slot book-keeping of the DRAM tier's memory: size classes carved from chunks (``SlabAllocator``
for a staging arena), within a growth budget every tenant's memory shares (``GrowthBudget``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import CapacityError

PAGE_ALIGN = 4096  # slot sizes, chunk offsets and growth steps are multiples of this


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
