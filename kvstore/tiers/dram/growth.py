"""The DRAM tier's memory and how it changes: tenants' memory made, grown (ahead of demand too),
taken back for another tenant, pinned for CUDA, and steps that linger while clients map them.

``Growth`` owns every tenant's memory (``TenantMemory``: a staging arena and published steps)
within one ``GrowthBudget``; it grows under one lock, so a plan made under it cannot go stale.
The tier asks it for slots (``published_slot``, ``staging_slot``), which grow memory or take
free memory back when none is free, and whether a page would fit (``fits``, ``fits_for``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvstore.config import DramConfig
from kvstore.errors import CapacityError, shown
from kvstore.keys import BlockKey
from kvstore.page import PUBLISHED_HEADER_BYTES
from kvstore.tiers.dram.arena import SealedStep, ShmArena, Step, StepPool
from kvstore.tiers.dram.lingering import LingeringSteps
from kvstore.tiers.dram.overreach import StagingOverreach
from kvstore.tiers.dram.slabs import GrowthBudget, SlabAllocator, Slot, round_down, round_up

log = logging.getLogger("kvstore.tiers.dram")  # the DRAM tier's logger: these are its messages

# Growth ahead of demand (the next step, made while nothing waits for it) runs on a thread of its
# own, this much nicer (Linux keeps a nice value per thread): faulting in a step takes a core for
# milliseconds, and the calls the loop answers meanwhile must not wait for it on a small host. On
# the 2-core box (2026-12-02) a Lookup right after a 64 MiB put took 0.93 ms on average, 3.46 at
# worst, while the tier grew, against 0.57 and 0.62 once it had grown.
AHEAD_NICE = 10

# A published step given back while a view of it is still read in this process stays charged
# until that view goes (``kvstore.tiers.dram.lingering``). Such a reader (a Get sending a page
# deleted meanwhile) is usually done within a few loop turns: the write that needed the memory
# tries again every LINGER_POLL_S for up to LINGER_WAIT_S; later writes that take memory back
# try at most every LINGER_CHECK_S.
LINGER_WAIT_S = 0.25
LINGER_POLL_S = 0.01
LINGER_CHECK_S = 1.0

# Every arena maps the tier's whole capacity of address space up front (so views never move);
# 1024 arenas of 64 GiB take half of the 128 TiB a process can map.
MAX_ARENAS = 1024

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and addressable
# from kernels through unified addressing.
_CUDA_HOST_REGISTER_FLAGS = 1 | 2


@dataclass(slots=True, eq=False)
class TenantMemory:
    """One tenant's memory: its staging arena (the memfd, the allocator that carves it and the
    region name clients ask for) and its published steps."""

    tenant: str
    region: str  # the staging arena's
    memory: ShmArena
    alloc: SlabAllocator
    steps: StepPool
    pinned: list[int] = field(default_factory=list)  # registered staging addresses
    keys_by_step: dict[str, set[BlockKey]] = field(default_factory=dict)  # region -> keys
    outside_bytes: int = 0  # staging held outside what was lent, charged (``overreach``)

    @property
    def backed_bytes(self) -> int:
        return self.alloc.backed_bytes + self.steps.backed_bytes + self.outside_bytes

    @property
    def releasable_bytes(self) -> int:
        return self.alloc.releasable_bytes + self.steps.releasable_bytes


def _lower_priority() -> None:
    """Make the calling thread ``AHEAD_NICE`` nicer (only it: Linux keeps nice per thread)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + AHEAD_NICE))


class Growth:
    """Every tenant's memory of one DRAM tier, and its growth, take-back and pinning.

    ``make_step`` backs a new published step in a growth thread (the tier's hook; it calls
    ``back_step``). Called from the tier's event loop only.
    """

    def __init__(self, name: str, config: DramConfig,
                 make_step: Callable[[Step], None]) -> None:
        self.name = name
        self.config = config
        self.budget = GrowthBudget(config.capacity_bytes)
        self.arenas: dict[str, TenantMemory] = {}  # by tenant
        self.regions: dict[str, tuple[TenantMemory, ShmArena | SealedStep]] = {}  # by region
        self.is_open = False
        self.lingering = LingeringSteps()
        self._make_step = make_step
        self._grow_lock = asyncio.Lock()  # one for all memory: it grows within one budget
        # Staging memory clients made their arenas hold outside what was lent: punched, charged.
        self.overreach = StagingOverreach(self.budget, self.arenas, lambda: self._grow_lock)
        self._grow_task: asyncio.Task[None] | None = None
        self._grower = ThreadPoolExecutor(1, thread_name_prefix="kvstore-dram-grow",
                                          initializer=_lower_priority)
        self._pin_cuda = False
        self._retired_listeners: list[Callable[[str], None]] = []
        self._lingering_checked = 0.0  # time.monotonic() of the last look

    def on_retired(self, listener: Callable[[str], None]) -> None:
        self._retired_listeners.append(listener)

    async def close(self, forget: Callable[[], None]) -> None:
        """Wait for growth in flight, then (under the grow lock, after ``forget``: the tier
        drops its pages) unpin and close all memory."""
        self.is_open = False
        await self.overreach.stop()
        if self._grow_task is not None:  # it takes the lock itself, then sees the tier closed
            await asyncio.gather(self._grow_task, return_exceptions=True)
        async with self._grow_lock:  # a write may still be growing
            forget()
            for arena in self.arenas.values():
                self._unpin(arena)
                arena.memory.close()
                for step in arena.steps.take_all():
                    self.retire(step, free=False)  # clients may read under their leases still
            for held in self.lingering.take_all():
                held.memory.retire(free=False)
            self.arenas.clear()
            self.regions.clear()
        self._grower.shutdown(wait=False)

    def arena(self, tenant: str) -> TenantMemory:
        """``tenant``'s memory, made on first use (a sealed staging memfd; nothing grown)."""
        arena = self.arenas.get(tenant)
        if arena is not None:
            return arena
        if len(self.arenas) >= MAX_ARENAS:
            raise CapacityError(f"the {self.name} tier holds {MAX_ARENAS} tenant arenas, its "
                                f"limit; tenant {shown(tenant)} gets none")
        capacity_bytes = self.budget.capacity_bytes
        region = f"{self.name}.{secrets.token_hex(8)}"
        memory = ShmArena(f"kvstore-{region}", capacity_bytes)
        memory.create()
        alloc = SlabAllocator(capacity_bytes, self.config.chunk_bytes, self.budget)
        alloc.merge_growth = not self._pin_cuda
        arena = TenantMemory(tenant, region, memory, alloc, StepPool(self.config.chunk_bytes))
        self.arenas[tenant] = arena
        self.regions[region] = (arena, memory)
        log.info("dram: made arena %s for tenant %s", region, shown(tenant))
        return arena

    # --- what fits ---------------------------------------------------------------------------

    def spare_bytes(self, arena: TenantMemory | None = None) -> int:
        """Memory the budget has left, with what tenants could give back, for ``arena`` to
        grow into (None: anyone): all of every other tenant's free memory, and its own empty
        steps but not its free staging memory. A tenant's staging memory stays its writers'
        while nobody else needs it: turning it into published memory and back with each
        zero-copy put would empty a whole step of its blocks every few puts."""
        spare = self.budget.room_bytes
        for other in self.arenas.values():
            if other is arena:
                spare += other.steps.releasable_bytes
            elif self.may_take_from_others(arena):
                spare += other.releasable_bytes
        return spare

    def may_take_from_others(self, arena: TenantMemory | None) -> bool:
        """Whether ``arena`` may grow into memory other tenants let go: not while given-back
        steps of its own are still held (``lingering``), nor while its staging arena holds
        memory outside what was lent (``overreach``), so what they hold is its own loss."""
        return arena is None or not (self.lingering.nbytes_of(arena.tenant)
                                     or self.overreach.charged.get(arena.tenant))

    def fits(self, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits now without deleting pages: for any tenant when
        the budget (with the free memory it could take back) holds a step of one slot, else
        when some tenant's published memory has a free slot of its class."""
        slot_bytes = SlabAllocator.slot_bytes_for(nbytes)
        if slot_bytes > max(0, self.budget.capacity_bytes - PUBLISHED_HEADER_BYTES):
            return False
        return self.spare_bytes() >= PUBLISHED_HEADER_BYTES + slot_bytes or any(
            a.steps.fits(nbytes) for a in self.arenas.values())

    def fits_for(self, arena: TenantMemory | None, nbytes: int) -> bool:
        """Whether a page of ``nbytes`` fits in ``arena``'s published memory (None: a tenant
        with none yet) without deleting pages."""
        if arena is not None and arena.steps.fits(nbytes):
            return True
        return self.spare_bytes(arena) >= PUBLISHED_HEADER_BYTES + \
            SlabAllocator.slot_bytes_for(nbytes)

    # --- slots, grown for when none is free --------------------------------------------------

    async def published_slot(self, arena: TenantMemory, nbytes: int) -> tuple[Step, Slot] | None:
        """A free published slot for a page of ``nbytes`` (grown or taken back if need be)."""
        return arena.steps.allocate(nbytes) or await self._publish_slow(arena, nbytes)

    async def staging_slot(self, arena: TenantMemory, nbytes: int) -> Slot | None:
        """A free staging slot of at least ``nbytes`` (grown or taken back if need be)."""
        return arena.alloc.allocate(nbytes) or await self._allocate_slow(arena, nbytes)

    async def reserve(self, arena: TenantMemory, nbytes: int) -> int:
        """Grow ``arena``'s published memory to ``nbytes`` (``DramTier.reserve``)."""
        target = min(round_up(max(nbytes, 0)), self.budget.capacity_bytes)
        while self.is_open and arena.steps.backed_bytes < target:
            async with self._grow_lock:
                step_bytes = round_down(min(arena.steps.chunk_bytes,
                                            target - arena.steps.backed_bytes,
                                            self.budget.room_bytes))
                if (not self.is_open or step_bytes <= PUBLISHED_HEADER_BYTES
                        or not await self._grow_step(arena, step_bytes)):
                    break
        return arena.steps.backed_bytes

    async def _publish_slow(self, arena: TenantMemory, nbytes: int) -> tuple[Step, Slot] | None:
        # Growth happens under the lock only, so a plan made under it cannot go stale.
        async with self._grow_lock:
            while self.is_open:
                found = arena.steps.allocate(nbytes)
                if found is not None:
                    return found
                step_bytes = arena.steps.step_bytes_for(nbytes, self.budget.room_bytes)
                if step_bytes is None:
                    if not await self._take_back(arena, PUBLISHED_HEADER_BYTES +
                                                 SlabAllocator.slot_bytes_for(nbytes)):
                        return None
                    continue
                if not await self._grow_step(arena, step_bytes):
                    return None
        return None

    async def _allocate_slow(self, arena: TenantMemory, nbytes: int) -> Slot | None:
        async with self._grow_lock:
            while self.is_open:
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

    # --- taking memory back ------------------------------------------------------------------

    async def _take_back(self, arena: TenantMemory, need_bytes: int) -> bool:
        """Give free memory back to the budget for ``arena`` to grow (free staging chunks and
        empty published steps of other tenants, then its own empty steps: ``spare_bytes``)
        until it holds ``need_bytes``; False (nothing given back) when all of it would not be
        enough."""
        if self.lingering:  # steps given back earlier whose last view here went since
            await self.settle_lingering()
        short = need_bytes - self.budget.room_bytes
        if short <= 0 or self.spare_bytes(arena) < need_bytes:
            return False
        donors = sorted((a for a in self.arenas.values()
                         if a is arena or self.may_take_from_others(arena)),
                        key=lambda a: (a is arena, -a.releasable_bytes))
        held_here = False
        for donor in donors:
            retired = False
            staging = donor.alloc.release_free(short) if short > 0 and donor is not arena else ()
            for offset, size in staging:
                await asyncio.to_thread(donor.memory.release, offset, size)
                log.info("dram: took %d free bytes at %d back from arena %s", size, offset,
                         donor.region)
                short -= size
            for step in donor.steps.take_empty(short) if short > 0 else ():
                self.regions.pop(step.region, None)
                donor.keys_by_step.pop(step.region, None)
                if await asyncio.to_thread(self.retire, step):  # its memory is gone
                    self.budget.grown_bytes -= step.nbytes
                else:  # read here still: charged until its last view goes
                    self.lingering.add(step.region, step.memory, donor.tenant)
                    held_here = True
                log.info("dram: gave back published step %s (%d bytes) of tenant %s",
                         step.region, step.nbytes, shown(donor.tenant))
                short -= step.nbytes
                retired = True
            if retired:  # clients drop their mappings of the header pages left
                for listener in self._retired_listeners:
                    listener(donor.tenant)
        if held_here:
            deadline = time.monotonic() + LINGER_WAIT_S
            while self.lingering and time.monotonic() < deadline:
                await asyncio.sleep(LINGER_POLL_S)
                await self.settle_lingering(now=True)
            self.lingering.warn()
        return True

    async def settle_lingering(self, now: bool = False) -> None:
        """Give the budget back the given-back steps no view here reads any more (cut down to
        their header page now): at most every ``LINGER_CHECK_S`` unless ``now``."""
        if not now and time.monotonic() - self._lingering_checked < LINGER_CHECK_S:
            return
        freed = await asyncio.to_thread(self.lingering.try_free)
        self.budget.grown_bytes -= self.lingering.forget(freed)
        self._lingering_checked = time.monotonic()

    # --- growing -----------------------------------------------------------------------------

    def grow_ahead(self, arena: TenantMemory, nbytes: int) -> None:
        """After a page of ``nbytes`` landed: grow the next step in the background, if idle."""
        idle = self._grow_task is None or self._grow_task.done()
        if idle and not self._grow_lock.locked() and self._spare_step_bytes(arena, nbytes):
            self._grow_task = asyncio.get_running_loop().create_task(self._spare(arena, nbytes))

    def _spare_step_bytes(self, arena: TenantMemory, nbytes: int) -> int:
        """Bytes of a whole step for pages of ``nbytes`` to grow ahead, or 0 when ``arena``
        has an empty step ready or the budget does not hold a whole one."""
        whole = arena.steps.step_bytes_for(nbytes, self.budget.capacity_bytes) or 0
        if arena.steps.releasable_bytes or whole > self.budget.room_bytes:
            return 0
        return whole

    async def _spare(self, arena: TenantMemory, nbytes: int) -> None:
        async with self._grow_lock:
            step_bytes = self._spare_step_bytes(arena, nbytes)
            if self.is_open and step_bytes:
                await self._grow_step(arena, step_bytes, ahead=True)

    async def _grow_step(self, arena: TenantMemory, nbytes: int, ahead: bool = False) -> bool:
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
        if not self.is_open:
            await asyncio.to_thread(self.retire, step)
            return False
        self.budget.grown_bytes += nbytes
        arena.steps.add(step)
        self.regions[region] = (arena, step.memory)
        return True

    def back_step(self, step: Step) -> None:
        """Back ``step``'s memory (in a growth thread), pinned while pinning is on."""
        step.memory.create()
        if self._pin_cuda:
            try:
                self._register(step.memory.base_address(), step.nbytes)
            except CapacityError as exc:  # the bytes stay usable, only DMA from them is slower
                log.warning("dram: step %s stays pageable: %s", step.region, exc)

    def retire(self, step: Step, free: bool = True) -> bool:
        """Unpin and retire ``step`` (``SealedStep.retire``): True once its memory is freed
        (or, without ``free``, let go). Blocking: call it in a thread."""
        if self._pin_cuda and step.memory.base_address():
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostUnregister(step.memory.base_address()))
            if err:
                cudart.cudaGetLastError()  # a refusal must not fail a later CUDA call
            if err not in (0, 713):  # 713: cudaErrorHostMemoryNotRegistered (it stayed pageable)
                log.warning("dram: cudaHostUnregister failed (cudaError %d)", err)
        return step.memory.retire(free)

    async def _grow_locked(self, arena: TenantMemory, nbytes: int,
                           offset: int | None = None) -> bool:
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

    def _grow_blocking(self, arena: TenantMemory, nbytes: int, offset: int) -> int:
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

    # --- pinning -----------------------------------------------------------------------------

    async def pin_cuda(self) -> bool:
        """Register all memory as pinned host memory (``DramTier.pin_cuda``)."""
        if not torch.cuda.is_available():
            return False
        async with self._grow_lock:
            if not self._pin_cuda:
                for arena in self.arenas.values():
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

    @staticmethod
    def _register(address: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_FLAGS))
        if err != 0:
            raise CapacityError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})")

    @staticmethod
    def _unpin(arena: TenantMemory) -> None:
        for address in arena.pinned:
            err = int(torch.cuda.cudart().cudaHostUnregister(address))
            if err != 0:
                log.warning("dram: cudaHostUnregister failed (cudaError %d)", err)
        arena.pinned.clear()
