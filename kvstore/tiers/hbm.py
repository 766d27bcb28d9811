"""The HBM tier: device pages in one dedicated GPU allocation per tenant and GPU, exported over
CUDA IPC.

Each tenant's pages live in pools of its own, one per GPU of the tier (``hbm.device`` lists
them): one ``cudaMalloc`` (through cupy's runtime, never a piece of a caching allocator), cut
into slots and exported once through a CUDA IPC memory handle. The handle goes only to that
tenant's clients (in the ``region`` of their leases and reservations, after the token check),
which map the pool once per process and address slots by offset. A block lies in one pool: a
reservation's slots and a lease's promotions go to the GPU the request names
(``NEAR_DEVICE``) while it has room, else to another of the tier's; an engine on one GPU reads
a pool on another through peer access. A CUDA IPC mapping cannot be made read-only, so a tenant
can write its own pool at any time: isolation is the pool, not a seal. Pages leave the pool (a
get, a demotion) through this tier, which frames them as checksummed host pages; a lower tier
never trusts the device bytes beyond the tenant that wrote them.

Slots hold device pages (``kvstore.codecs.device``): a block's codec sections at aligned offsets,
so the engine kernels (``kvstore.codecs.triton.engine``) read and write them in one launch.
A writer that encoded into a slot on its own stream hands over an interprocess event with its
commit; the tier waits on it (on its copy stream) before it reads that slot.

Without CUDA the tier runs on host memory (``device = "cpu"``, or ``"cpu:0,cpu:1"`` as if two
devices), for tests of the store's logic; such pools have no IPC handle and can be reached from
this process only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvstore.api import Medium, TierStats
from kvstore.codecs.base import framing_bytes, unpack_blob
from kvstore.codecs.device import SECTION_ALIGN, DeviceLayout, device_layout
from kvstore.config import HbmConfig
from kvstore.errors import CapacityError, CorruptPage, InvalidArgument, Unavailable, shown
from kvstore.ipc import device_id, export_cuda_pool, export_host_pool
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta, decode_page, encode_page, page_bytes
from kvstore.room import Footprint, RoomNeed
from kvstore.spec import KVSpec
from kvstore.tiers.base import NEAR_DEVICE, SlotTier

log = logging.getLogger(__name__)

MAX_POOLS = 64  # tenants with a pool on one GPU
READY_TIMEOUT_S = 30.0  # a writer's event must fire within this of a read of its slot


def _round(nbytes: int) -> int:
    return -(-max(nbytes, 1) // SECTION_ALIGN) * SECTION_ALIGN


@dataclass(slots=True, eq=False)
class _Pool:
    """One tenant's device allocation and the slots carved from it."""

    tenant: str
    device: int  # which of the tier's devices
    region: str
    memory: torch.Tensor  # uint8 view of the whole allocation
    nbytes: int
    owner: object = None  # what frees the allocation when the pool goes (cupy memory)
    # The pool's own copy stream and lock: a writer's event that fires late (a slow kernel
    # ahead of it) holds up its own tenant's copies only.
    stream: object = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    bump: int = 0  # bytes from here on were never handed out
    free: dict[int, list[int]] = field(default_factory=dict)  # slot bytes -> free offsets
    used: int = 0

    def take(self, slot_bytes: int) -> int | None:
        free = self.free.get(slot_bytes)
        if free:
            self.used += slot_bytes
            return free.pop()
        if self.bump + slot_bytes > self.nbytes:
            return None
        offset, self.bump = self.bump, self.bump + slot_bytes
        self.used += slot_bytes
        return offset

    def give(self, offset: int, slot_bytes: int) -> None:
        self.used -= slot_bytes
        self.free.setdefault(slot_bytes, []).append(offset)

    def fits(self, slot_bytes: int) -> bool:
        return bool(self.free.get(slot_bytes)) or self.bump + slot_bytes <= self.nbytes


@dataclass(frozen=True, slots=True)
class PoolSlot:
    pool: _Pool
    offset: int
    slot_bytes: int


@dataclass(slots=True)
class _Entry:
    slot: PoolSlot
    meta: PageMeta
    layout: DeviceLayout
    page_bytes: int  # its host page's length (what it takes in the tiers below)
    ready: object = None  # an event the slot's writer recorded; waited on before a read


def host_page_bytes(layout: DeviceLayout, meta: PageMeta) -> int:
    return page_bytes(_blob_bytes(layout), meta)


def _blob_bytes(layout: DeviceLayout) -> int:
    """Bytes of the codec blob that frames a device page of ``layout``."""
    blob = framing_bytes(len(layout.shape), len(layout.sections), len(layout.params))
    return blob + sum(s.nbytes for s in layout.sections)


def _on(stream: object):
    """Issue copies on ``stream`` (a pool's copy stream), or plainly without CUDA."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class HbmTier(SlotTier):
    """Device pages in per-tenant GPU pools; see the module docstring."""

    name = "hbm"

    def __init__(self, config: HbmConfig, name: str = "hbm") -> None:
        self.name = name
        self.config = config
        self._devices = [torch.device(d) for d in config.device_list()]
        self._device_ids: dict[str, int] = {}  # device_id -> index in _devices (once open)
        self._pools: dict[tuple[str, int], _Pool] = {}  # (tenant, device) -> its pool
        self._entries: dict[BlockKey, _Entry] = {}
        self._pending: dict[BlockKey, asyncio.Future[bool]] = {}
        self._slot_of_page: dict[int, int] = {}  # host page bytes -> device slot bytes
        # (codec, spec) -> its device layout and blob bytes: a commit of 512 slots asks 512
        # times, and building a layout costs more than publishing a slot.
        self._layouts: dict[tuple[str, KVSpec], tuple[DeviceLayout, int]] = {}
        self._last_layout: tuple[str, KVSpec, tuple[DeviceLayout, int]] | None = None
        # Asked twice per slot a reservation makes room for: the config is frozen.
        self._pool_size = min(config.pool_bytes or config.capacity_bytes, config.capacity_bytes)
        self._event: tuple[bytes, int, object] | None = None  # the last commit's event
        self._cuda = False
        self._is_open = False
        self._stats = TierStats(name=name)

    # --- identity and space ------------------------------------------------------------------

    @property
    def medium(self) -> Medium:
        return Medium.DEVICE

    @property
    def capacity_bytes(self) -> int:
        return self.config.capacity_bytes * len(self._devices)

    @property
    def devices(self) -> list[torch.device]:
        return list(self._devices)

    @property
    def used_bytes(self) -> int:
        return sum(pool.used for pool in self._pools.values())

    @property
    def max_page_bytes(self) -> int:
        return self.config.pool_bytes or self.config.capacity_bytes

    def _pool_bytes(self) -> int:
        return self._pool_size

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries

    def _slot_bytes(self, nbytes: int) -> int:
        """The slot a page of ``nbytes`` takes: a host page's device page is its sections
        without the framing, learnt from the pages seen; a size never seen is its own bound."""
        return self._slot_of_page.get(nbytes) or _round(nbytes)

    def room_for(self, nbytes: int) -> RoomNeed | None:
        slot_bytes = self._slot_bytes(nbytes)
        if slot_bytes <= self._pool_bytes() and (
                any(pool.fits(slot_bytes) for pool in self._pools.values())
                or any(self._can_make_pool(d) for d in range(len(self._devices)))):
            return None
        return RoomNeed(nbytes=slot_bytes, size_class=slot_bytes)

    def room_for_tenant(self, nbytes: int, tenant: str,
                        protected: Callable[[BlockKey], bool] | None = None
                        ) -> RoomNeed | None:
        """Each tenant's pages live in its own pools: room for one comes from its pools only
        (or a new pool, on a GPU whose capacity has one to spare), freed from its own blocks."""
        slot_bytes = self._slot_bytes(nbytes)
        if slot_bytes <= self._pool_bytes() and any(
                self._fits(tenant, d, slot_bytes) for d in range(len(self._devices))):
            return None
        return RoomNeed(nbytes=slot_bytes, size_class=slot_bytes, tenant=tenant)

    def _fits(self, tenant: str, device: int, slot_bytes: int) -> bool:
        """Could ``tenant`` have a slot of ``slot_bytes`` on ``device`` now?"""
        pool = self._pools.get((tenant, device))
        return pool.fits(slot_bytes) if pool is not None else self._can_make_pool(device)

    def _can_make_pool(self, device: int) -> bool:
        on_device = [pool.nbytes for (_, d), pool in self._pools.items() if d == device]
        return (len(on_device) < MAX_POOLS
                and self.config.capacity_bytes - sum(on_device) >= self._pool_bytes())

    def footprint(self, key: BlockKey) -> Footprint | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        return Footprint(size_class=entry.slot.slot_bytes, nbytes=entry.slot.slot_bytes)

    def _layout(self, codec: str, spec: KVSpec) -> tuple[DeviceLayout, int]:
        """The device layout of ``codec`` pages of ``spec`` and their blob's bytes (the slots
        of one commit share their namespace's spec: that one is matched by identity, without
        hashing it)."""
        last = self._last_layout
        if last is not None and last[1] is spec and last[0] == codec:
            return last[2]
        found = self._layouts.get((codec, spec))
        if found is None:
            layout = device_layout(codec, spec)
            found = (layout, _blob_bytes(layout))
            if len(self._layouts) < 1024:
                self._layouts[(codec, spec)] = found
        self._last_layout = (codec, spec, found)
        return found

    def _learn(self, layout: DeviceLayout, meta: PageMeta, blob_bytes: int | None = None) -> int:
        host = page_bytes(_blob_bytes(layout) if blob_bytes is None else blob_bytes, meta)
        if len(self._slot_of_page) < 4096:
            self._slot_of_page[host] = layout.nbytes
        return host

    def device_slot_bytes(self, codec: str, spec: KVSpec) -> int:
        """Bytes of the slot a writer of one block of ``spec`` under ``codec`` gets."""
        return device_layout(codec, spec).nbytes

    # --- lifecycle --------------------------------------------------------------------------

    async def open(self) -> None:
        if self._devices[0].type == "cuda":
            if not torch.cuda.is_available():
                raise Unavailable(f"the {self.name} tier is on {self._devices[0]}, but CUDA is "
                                  "not available in this process")
            count = torch.cuda.device_count()
            missing = [str(d) for d in self._devices if (d.index or 0) >= count]
            if missing:
                raise Unavailable(f"the {self.name} tier is on {', '.join(missing)}, but this "
                                  f"process sees {count} GPU(s) (check CUDA_VISIBLE_DEVICES)")
            try:
                import cupy  # noqa: F401  (the pools are cupy allocations)
            except ImportError as exc:
                raise Unavailable(f"the {self.name} tier needs cupy for its device pools: "
                                  f"{exc}") from None
            self._cuda = True
        self._device_ids = {device_id(d): i for i, d in enumerate(self._devices)}
        self._is_open = True

    async def close(self) -> None:
        self._is_open = False
        if self._cuda:
            for device in self._devices:
                torch.cuda.synchronize(device)
        self._entries.clear()
        self._pools.clear()

    def _check_open(self) -> None:
        if not self._is_open:
            raise Unavailable(f"{self.name} tier is not open")

    # --- pools ------------------------------------------------------------------------------

    def region_of(self, tenant: str) -> str:
        """What ``tenant``'s clients map on the GPU requests prefer now (``NEAR_DEVICE``, else
        the first): ``cuda-ipc:<device id>:<bytes>:<handle hex>`` for a GPU pool (the pool is
        made now if the tenant has none there), ``host:<id>`` without CUDA."""
        return self._pool(tenant, self._near()).region

    def slot_region(self, slot: PoolSlot, tenant: str) -> str:
        return slot.pool.region

    def _near(self) -> int:
        """The index of the device requests prefer now (the first when they name none, or one
        this tier does not have)."""
        near = NEAR_DEVICE.get()
        return self._device_ids.get(near, 0) if near else 0

    def _pool(self, tenant: str, device: int) -> _Pool:
        self._check_open()
        pool = self._pools.get((tenant, device))
        if pool is not None:
            return pool
        nbytes = self._pool_bytes()
        where = self._devices[device]
        if not self._can_make_pool(device):
            raise CapacityError(f"the {self.name} tier has no room on {where} for a pool of "
                                f"{nbytes} bytes for tenant {shown(tenant)}")
        if where.type == "cuda":
            import cupy

            with cupy.cuda.Device(where.index or 0):
                owner = cupy.cuda.memory.Memory(nbytes)  # its own cudaMalloc, no pool
            memory = torch.as_tensor(cupy.ndarray((nbytes,), cupy.uint8,
                                                  cupy.cuda.MemoryPointer(owner, 0)),
                                     device=where)
            region = export_cuda_pool(owner.ptr, nbytes, where.index or 0)
        else:
            owner = None
            raw = torch.empty(nbytes + SECTION_ALIGN, dtype=torch.uint8)
            pad = -raw.data_ptr() % SECTION_ALIGN
            memory = raw[pad:pad + nbytes]
            region = export_host_pool(memory, self.name)
        stream = torch.cuda.Stream(where) if self._cuda else None
        pool = self._pools[(tenant, device)] = _Pool(tenant, device, region, memory, nbytes,
                                                     owner, stream=stream)
        log.info("%s: made a %d-byte pool on %s for tenant %s", self.name, nbytes, where,
                 shown(tenant))
        return pool

    def pool_tensor(self, tenant: str, device: int = 0) -> torch.Tensor | None:
        """``tenant``'s pool memory on the tier's ``device``-th GPU in this process (None if it
        has none there): for tests, tools and an engine in the daemon's own process."""
        pool = self._pools.get((tenant, device))
        return None if pool is None else pool.memory

    def device_of(self, key: BlockKey) -> torch.device | None:
        """The GPU whose pool holds ``key`` (None if this tier holds none)."""
        entry = self._entries.get(key)
        return None if entry is None else self._devices[entry.slot.pool.device]

    # --- slots ------------------------------------------------------------------------------

    async def allocate_slot(self, nbytes: int, tenant: str) -> PoolSlot | None:
        """A slot in ``tenant``'s pool on the preferred GPU (``NEAR_DEVICE``) if it has room
        there, else on the first of the others that has."""
        self._check_open()
        slot_bytes = _round(nbytes)
        near = self._near()
        for device in (near, *(d for d in range(len(self._devices)) if d != near)):
            if not self._fits(tenant, device, slot_bytes):
                continue
            pool = self._pool(tenant, device)
            offset = pool.take(slot_bytes)
            if offset is not None:
                return PoolSlot(pool, offset, slot_bytes)
        self._stats.rejected += 1
        return None

    def slot_view(self, slot: PoolSlot) -> memoryview:
        raise InvalidArgument(f"{self.name} slots are device memory: a writer fills them with "
                              "the engine kernels, not through a host view")

    async def publish_sections(self, slot: PoolSlot, key: BlockKey, meta: PageMeta,
                               spec: KVSpec, ready_event: bytes = b"") -> int:
        """Make the device page a writer encoded into ``slot`` readable as ``key``; return the
        bytes of its host page. ``ready_event`` is the IPC handle of an event the writer
        recorded after its kernel: every read of the slot waits on it."""
        self._check_open()
        layout, blob_bytes = self._layout(meta.codec, spec)
        if meta.tenant != slot.pool.tenant or layout.nbytes > slot.slot_bytes:
            raise InvalidArgument(f"block {bytes(key).hex()} does not fit this slot of tenant "
                                  f"{shown(slot.pool.tenant)}'s pool")
        if key in self._entries:
            self.abort(slot)
            return self.page_size(key) or 0
        ready = self._ready_event(ready_event, slot.pool.device) if ready_event else None
        entry = self._entries[key] = _Entry(slot, meta, layout,
                                            self._learn(layout, meta, blob_bytes), ready)
        self._stats.bytes_written += layout.nbytes
        return entry.page_bytes

    def _ready_event(self, handle: bytes, device: int) -> object:
        """The writer's event named by IPC ``handle``, opened (on the tier's ``device``-th GPU,
        the slot's) once for all the slots of a commit (they share it: opening a handle per
        slot costs a driver call each). The cache holds the commit's own ``handle`` object and
        matches it by identity: another commit, even one whose handle has the same bytes (an
        event its writer destroyed and made again), opens its own."""
        if self._event is not None and self._event[0] is handle and self._event[1] == device:
            return self._event[2]
        where = self._devices[device]
        if where.type != "cuda":
            raise InvalidArgument("a ready event names a CUDA event; this pool is host memory")
        try:
            event = torch.cuda.Event.from_ipc_handle(where, handle)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"ready_event is not a CUDA IPC event handle: {exc}") from None
        self._event = (handle, device, event)
        return event

    def abort(self, slot: PoolSlot) -> None:
        slot.pool.give(slot.offset, slot.slot_bytes)

    def locate(self, key: BlockKey) -> tuple[str, int, int] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        return entry.slot.pool.region, entry.slot.offset, entry.layout.nbytes

    # --- pages in and out -------------------------------------------------------------------

    async def write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        """Copy a host page's sections into a slot of its tenant's pool (a promotion, or a put
        when this tier heads the chain); False when there is no room."""
        self._check_open()
        if key in self._entries:
            return True
        if key in self._pending:  # a promotion of the same block is copying it in
            return await asyncio.shield(self._pending[key])
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[key] = done
        try:
            return await self._write(key, page, meta)
        finally:
            del self._pending[key]
            done.set_result(key in self._entries)

    async def _write(self, key: BlockKey, page: bytes | memoryview, meta: PageMeta) -> bool:
        try:
            parsed = decode_page(page, key)
            blob = unpack_blob(parsed.payload, verify=False)
            shape = blob.shape
            spec = KVSpec(num_layers=shape[0], num_kv_heads=shape[3], head_dim=shape[4],
                          block_tokens=shape[2], dtype=blob.dtype)
            layout = device_layout(meta.codec, spec)
            sections = layout.from_blob(parsed.payload)
        except (CorruptPage, ValueError) as exc:
            raise InvalidArgument(f"{self.name} write of key {bytes(key).hex()}: {exc}") from None
        slot = await self.allocate_slot(layout.nbytes, meta.tenant)
        if slot is None:
            return False
        try:
            async with slot.pool.lock:
                await asyncio.to_thread(self._copy_in, slot, layout, sections)
        except BaseException:
            self.abort(slot)
            raise
        if key in self._entries:
            self.abort(slot)
            return True
        self._entries[key] = _Entry(slot, meta, layout, self._learn(layout, meta))
        self._stats.bytes_written += layout.nbytes
        return True

    def _copy_in(self, slot: PoolSlot, layout: DeviceLayout, sections: list[memoryview]) -> None:
        memory, stream = slot.pool.memory, slot.pool.stream
        with _on(stream):
            for section, view in zip(layout.sections, sections):
                start = slot.offset + section.offset
                source = torch.frombuffer(view, dtype=torch.uint8)
                memory[start:start + section.nbytes].copy_(source)
            if stream is not None:
                stream.synchronize()

    def _copy_out(self, entry: _Entry) -> list[torch.Tensor]:
        memory, stream = entry.slot.pool.memory, entry.slot.pool.stream
        with _on(stream):
            if entry.ready is not None:  # the writer's kernel may still be running
                stream.wait_event(entry.ready)
            out = []
            for section in entry.layout.sections:
                start = entry.slot.offset + section.offset
                out.append(memory[start:start + section.nbytes].to("cpu", copy=True))
        return out

    async def read(self, key: BlockKey, *, verify: bool = True) -> Page | None:
        """The block of ``key`` framed as a host page (a copy off the device), or None."""
        self._check_open()
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        if entry.ready is not None and not await self._fired(entry):
            log.warning("%s: dropping block %s: its writer's event has not fired after %g s",
                        self.name, bytes(key).hex(), READY_TIMEOUT_S)
            if self._entries.get(key) is entry:
                await self.delete(key)
            self._stats.corrupt += 1
            self._stats.misses += 1
            return None
        async with entry.slot.pool.lock:
            sections = await asyncio.to_thread(self._copy_out, entry)
        if self._entries.get(key) is not entry:  # deleted while copying
            self._stats.misses += 1
            return None
        data = encode_page(entry.meta, entry.layout.to_blob(sections))
        self._stats.hits += 1
        self._stats.bytes_read += entry.layout.nbytes
        return decode_page(data, key)

    async def _fired(self, entry: _Entry) -> bool:
        """Wait, without holding a thread, until the writer's event fired (True), at most
        READY_TIMEOUT_S: a writer that records its event behind a kernel that never ends
        loses that block, and holds up nothing else."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        delay = 1e-4
        while not entry.ready.query():
            if loop.time() > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.01)
        entry.ready = None
        return True

    async def delete(self, key: BlockKey) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.abort(entry.slot)
        return True

    def entries(self) -> Iterator[PageMeta]:
        return iter([entry.meta for entry in self._entries.values()])

    def page_size(self, key: BlockKey) -> int | None:
        """Bytes of the block's host page (what it takes in the tiers below)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.page_bytes

    def stats(self) -> TierStats:
        s = self._stats
        return TierStats(
            name=self.name, capacity_bytes=self.capacity_bytes, used_bytes=self.used_bytes,
            num_blocks=len(self._entries), hits=s.hits, misses=s.misses, corrupt=s.corrupt,
            rejected=s.rejected, bytes_read=s.bytes_read, bytes_written=s.bytes_written,
            extra={"pools": len(self._pools),
                   "pool_bytes": sum(pool.nbytes for pool in self._pools.values()),
                   "devices": len(self._devices)},
        )


__all__ = ["HbmTier", "PoolSlot"]
