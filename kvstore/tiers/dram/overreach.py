"""Staging memory a client holds outside the slots lent to it: measured, punched out, charged.

A tenant's staging arena is one memfd the size of the tier's whole capacity, and its clients
map all of it writable: only the ranges the tier grew (``SlabAllocator.backed_ranges``) are
lent, but a client touching any other page of its mapping, or calling fallocate on its
descriptor, makes the memfd allocate it (issue 28: with 8 MiB lent, one read of every page
made a 64 MiB arena hold 64 MiB outside the budget). The daemon cannot stop the touch; it can
see it and undo it. The memfd's block count (``ShmArena.held_bytes``) says what it holds; when
that is more than what was lent, every range not lent is punched out (``ShmArena.punch``; a
client reading there again reads zeros, no page it was lent changes), and what it still holds
past what was lent once punched is charged to the budget, as the tenant's own memory, until a
sweep finds it gone. What this does not bound: a client touching its whole mapping in a loop
refills it within about a millisecond of each punch (bench/staging_overreach.py), so between
sweeps its arena holds most of the capacity again; only memory the client cannot reach (a
memfd per lent chunk) would bound that. Sweeps run every ``SWEEP_S`` under the grow lock (growth and take-back change
the lent ranges), one fstat per arena when nothing is amiss.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from kvstore.errors import shown
from kvstore.tiers.dram.slabs import GrowthBudget

log = logging.getLogger("kvstore.tiers.dram")  # the DRAM tier's logger: these are its messages

# How often every arena's block count is read. A client can hold memory outside its lent ranges
# for at most about this long before it is punched out (or charged, if it is touched again).
SWEEP_S = 0.5


def unlent_ranges(backed: list[tuple[int, int]], capacity_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of every range of an arena of ``capacity_bytes`` outside the
    ``backed`` ones (sorted, not overlapping)."""
    ranges, start = [], 0
    for offset, nbytes in sorted(backed):
        if offset > start:
            ranges.append((start, offset - start))
        start = max(start, offset + nbytes)
    if start < capacity_bytes:
        ranges.append((start, capacity_bytes - start))
    return ranges


class StagingOverreach:
    """What each tenant's staging arena holds outside its lent ranges, charged to ``budget``.
    Called from the tier's event loop (the punching runs in a thread)."""

    def __init__(self, budget: GrowthBudget, arenas: dict,
                 lock: Callable[[], AbstractAsyncContextManager]) -> None:
        self._budget = budget
        self._arenas = arenas  # by tenant: Growth's TenantMemory
        self._lock = lock
        self.charged: dict[str, int] = {}  # tenant -> bytes held outside, charged to budget
        self.punched_bytes = 0  # memory freed by punching, in all
        self._warned: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._sweeping = False  # the task is inside a sweep: not to be cancelled there
        self._stopping = False

    @property
    def nbytes(self) -> int:
        return sum(self.charged.values())

    def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """End the sweeps (the tier closing): one under way runs to its end first, since a
        punch cancelled in its thread could go on into a mapping closed and reused meanwhile."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            if not self._sweeping:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._budget.grown_bytes -= self.nbytes
        self.charged.clear()
        for arena in self._arenas.values():
            arena.outside_bytes = 0

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(SWEEP_S)
            self._sweeping = True
            try:
                await self.sweep()
            except Exception:  # logged; the next sweep tries again, the tier goes on serving
                log.exception("dram: staging sweep failed")
            finally:
                self._sweeping = False

    async def sweep(self) -> int:
        """Punch out what every arena holds outside its lent ranges and charge what is left;
        the bytes charged now."""
        async with self._lock():
            for arena in list(self._arenas.values()):
                await self._sweep_one(arena)
        return self.nbytes

    async def _sweep_one(self, arena) -> None:
        memory = arena.memory
        lent = arena.alloc.backed_bytes
        held = memory.held_bytes
        # Charged: what it still holds outside once punched (touched again meanwhile), as the
        # tenant's own memory (``TenantMemory.backed_bytes``), so it is the first to give
        # memory back when another tenant needs room. Not what the punch freed: charging that
        # until the next sweep would take room from every other tenant for a memory that is
        # gone (a client touching its mapping in a loop fills it again within milliseconds of
        # each punch all the same: module docstring).
        outside = max(0, held - lent)
        if outside:
            ranges = unlent_ranges(arena.alloc.backed_ranges(), memory.capacity_bytes)
            await asyncio.to_thread(memory.punch, ranges)
            after = memory.held_bytes
            self.punched_bytes += max(0, held - after)
            outside = max(0, after - lent)
            if arena.tenant not in self._warned:
                self._warned.add(arena.tenant)
                log.warning("dram: tenant %s's staging arena %s held %d bytes, %d of them "
                            "outside the %d lent to it: punched out", shown(arena.tenant),
                            arena.region, held, held - lent, lent)
        before = self.charged.pop(arena.tenant, 0)
        if outside:
            self.charged[arena.tenant] = outside
        arena.outside_bytes = outside
        self._budget.grown_bytes += outside - before
