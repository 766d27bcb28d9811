"""Leases (pinned zero-copy reads) and reservations (zero-copy writes), over whichever tier of
the chain lends slots (``SlotTier``); prefetch hints are kvstore.store.hints."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from kvstore.api import MAX_LEASE_S, BlockLocations, Lease, Medium, Reservation, SlotGrants
from kvstore.codecs.base import Codec, bits_all_finite, blob_header, is_all_finite
from kvstore.codecs.raw import RawCodec
from kvstore.config import QuotaConfig
from kvstore.errors import (
    CapacityError,
    CodecError,
    CorruptPage,
    InvalidArgument,
    LeaseNotFound,
    NoSlotTier,
    shown,
)
from kvstore.keys import KEY_BYTES, BlockKey, Namespace
from kvstore.page import HEADER_BYTES, MAX_META_BYTES, PageMeta, PageSeal, page_length, parse_page
from kvstore.spec import KVSpec
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.placement import Count, Link, Placement
from kvstore.tiers.base import NEAR_DEVICE, CheckedCopies, DevicePages, Slot, SlotTier

log = logging.getLogger("kvstore.leases")

REAPER_INTERVAL_S = 0.25  # how often expired leases and reservations are reclaimed
# Promotions one acquire keeps in flight: SSD reads of 2 MiB pages in worker threads overlap
# (one at a time, a read waits on the disk's latency and nothing else runs on it).
PROMOTE_WINDOW = 16
# What decoding a garbage payload can raise: CodecError (a ValueError) for what the codecs
# check, the rest from torch and struct on what they do not.
_DECODE_FAILURES = (ValueError, RuntimeError, TypeError, IndexError, OverflowError, MemoryError,
                    struct.error)


def page_bound(codec: Codec, spec: KVSpec) -> int:
    """Upper bound on the encoded page of one block of ``spec`` under ``codec`` (the slot size a
    zero-copy writer is given)."""
    payload = codec.bytes_per_element(spec) * spec.elements_per_block
    # zstd can expand incompressible data by a few bytes per 128 KiB block plus its frame.
    slack = 64 + spec.block_bytes // 1024 if "zstd" in codec.name else 0
    return HEADER_BYTES + MAX_META_BYTES // 64 + int(payload) + 64 + slack


@dataclass(slots=True)
class LeaseHold:
    """Pinned entries of a lease."""

    held_id: str
    deadline: float
    tenant: str
    entries: list[BlockEntry]


@dataclass(slots=True)
class ReservedSlot:
    """A slot lent for one block of a reservation."""

    key: BlockKey
    block_index: int
    parent: BlockKey | None
    link: Link
    slot: Slot


@dataclass(slots=True)
class ReservationHold:
    held_id: str
    deadline: float
    ns: Namespace
    slots: list[ReservedSlot]
    # The prompt's keys up to its last reserved block: what was stored of them when the
    # commit makes room stays (a put in pieces never evicts its own head).
    prefix: tuple[BlockKey, ...] = ()

    @property
    def tenant(self) -> str:
        return self.ns.tenant


H = TypeVar("H", LeaseHold, ReservationHold)


class HeldTable(Generic[H]):
    """Leases or reservations by id, expiring at their deadline."""

    def __init__(self, kind: str, max_per_tenant: int) -> None:
        self.kind = kind
        self._held: dict[str, H] = {}
        self._per_tenant: dict[str, int] = {}
        self._max_per_tenant = max_per_tenant

    def __len__(self) -> int:
        return len(self._held)

    def check_room(self, tenant: str) -> None:
        """CapacityError if ``tenant`` already holds as many as it may."""
        if self._per_tenant.get(tenant, 0) >= self._max_per_tenant:
            raise CapacityError(f"tenant {shown(tenant)} holds {self._max_per_tenant} open "
                                f"{self.kind}s, its quota; release or commit some first")

    def add(self, held: H) -> H:
        self._held[held.held_id] = held
        self._per_tenant[held.tenant] = self._per_tenant.get(held.tenant, 0) + 1
        return held

    def get(self, held_id: str) -> H | None:
        return self._held.get(held_id)

    def pop(self, held_id: str) -> H:
        """Remove and return a holding; one past its deadline but not yet reaped still counts."""
        held = self._held.pop(held_id, None)
        if held is None:
            raise LeaseNotFound(f"{self.kind} {shown(held_id)} does not exist or has expired")
        self._forget(held)
        return held

    def expired(self, now: float | None = None) -> list[H]:
        """Remove and return everything past its deadline."""
        now = time.time() if now is None else now
        gone = [h for h in self._held.values() if h.deadline < now]
        for held in gone:
            del self._held[held.held_id]
            self._forget(held)
        return gone

    def _forget(self, held: H) -> None:
        left = self._per_tenant[held.tenant] - 1
        if left:
            self._per_tenant[held.tenant] = left
        else:
            del self._per_tenant[held.tenant]


class LeaseManager:
    """Owns the store's leases and reservations and reclaims them at their deadline.

    Args:
        directory: the store's block directory.
        placement: the store's placement over the chain (promotion, making room).
        lease_timeout_s: lease length when a caller does not ask for one.
        count: adds to the store's request counters.
        spawn: runs a coroutine in the background, owned by the store.
    """

    def __init__(self, directory: BlockDirectory, placement: Placement, lease_timeout_s: float,
                 quota: QuotaConfig, count: Count,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self._dir = directory
        self._placement = placement
        self._lease_timeout_s = lease_timeout_s
        self._count = count
        self._spawn = spawn
        self._leases: HeldTable[LeaseHold] = HeldTable("lease", quota.max_open_leases)
        self._reservations: HeldTable[ReservationHold] = HeldTable(
            "reservation", quota.max_open_reservations)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def _deadline(self, lease_s: float | None) -> float:
        if lease_s is None:
            lease_s = self._lease_timeout_s
        elif not 0 < lease_s <= MAX_LEASE_S:
            raise InvalidArgument(f"lease_s must be in (0, {MAX_LEASE_S}], got {lease_s}")
        return time.time() + lease_s

    def _slot_link(self, medium: Medium) -> Link:
        link = self._placement.slot_link(medium)
        if link is None:
            raise NoSlotTier(f"no tier of this store lends {medium.value} slots for "
                             "zero-copy reads and writes; use put and get")
        return link

    # ------------------------------------------------------------------------------ leases

    async def acquire(self, ns: Namespace, keys: list[BlockKey], lease_s: float | None,
                      medium: Medium = Medium.HOST, first_block: int = 0,
                      device: str = "") -> Lease:
        """Pin the stored prefix of ``keys`` in the fastest slot tier of ``medium`` (promoting
        into it, up to ``PROMOTE_WINDOW`` blocks at once).

        ``first_block``: pin only the prefix's blocks from this one on (a client loading a long
        prefix in pieces holds the earlier ones already); the lease's ``matched_tokens`` still
        count from the prompt's start. ``device``: the caller's GPU (``kvstore.ipc.device_id``),
        where promotions into a tier of several GPUs land while it has room.
        """
        if first_block < 0:
            raise InvalidArgument(f"first_block must be >= 0, got {first_block}")
        deadline = self._deadline(lease_s)
        self._leases.check_room(ns.tenant)
        link = self._slot_link(medium)
        tier: SlotTier = link.tier  # type: ignore[assignment]
        entries = self._dir.match_prefix(keys)
        wanted = entries[first_block:]
        self._dir.pin(wanted)
        landed = 0
        near = NEAR_DEVICE.set(device)  # the promotions' tasks inherit it
        try:
            landed = await self._promote_prefix(wanted, link)
        finally:
            NEAR_DEVICE.reset(near)
            self._dir.unpin(wanted[landed:])
        held = wanted[:landed]
        hold = self._leases.add(LeaseHold(secrets.token_hex(12), deadline, ns.tenant, held))
        self._dir.touch(held)
        matched = min(len(entries), first_block + landed)
        return Lease(hold.held_id, hold.deadline, matched * ns.spec.block_tokens,
                     _locations(tier, [entry.meta.key for entry in held]), link.codec.name,
                     link.name)

    async def _promote_prefix(self, entries: list[BlockEntry], link: Link) -> int:
        """How many of ``entries``, in order from the first, are in ``link``'s tier once those
        missing there are promoted, ``PROMOTE_WINDOW`` at a time (reads from an SSD or the
        shared tier overlap). Promotions past the first that fails are not started; those in
        flight then finish before this returns."""
        n = 0
        while n < len(entries) and link.name in entries[n].sizes:
            n += 1
        if n == len(entries):
            return n
        window = asyncio.Semaphore(PROMOTE_WINDOW)
        failed = False

        async def land(entry: BlockEntry) -> bool:
            async with window:
                return not failed and await self._placement.promote(entry, link)

        tasks = [asyncio.ensure_future(land(entry)) for entry in entries[n:]]
        try:
            for task in tasks:
                if not await task:
                    break
                n += 1
        finally:
            failed = True
            await asyncio.gather(*tasks, return_exceptions=True)
        return n

    def release(self, lease_id: str) -> None:
        self._dir.unpin(self._leases.pop(lease_id).entries)

    # ------------------------------------------------------------------------------ reservations

    async def reserve(self, ns: Namespace, keys: list[BlockKey], lease_s: float | None,
                      medium: Medium = Medium.HOST, device: str = "") -> Reservation:
        """Slots in the fastest slot tier for the blocks of ``keys`` not stored yet (``device``:
        the writer's GPU, where a tier of several GPUs lends them while it has room).

        A reservation claims nothing: a second writer of the same prefix (a put, or another
        reservation) proceeds at once, and whichever publishes a block first keeps it, so a
        writer that died never holds a prefix back until its deadline.
        """
        deadline = self._deadline(lease_s)
        self._reservations.check_room(ns.tenant)
        link = self._slot_link(medium)
        tier: SlotTier = link.tier  # type: ignore[assignment]
        if isinstance(tier, DevicePages):
            slot_bytes = tier.device_slot_bytes(link.codec.name, ns.spec)
        else:
            slot_bytes = page_bound(link.codec, ns.spec)
        if slot_bytes > tier.max_page_bytes:
            raise CapacityError(f"a {slot_bytes}-byte slot for one block can never fit tier "
                                f"{link.name} (largest page {tier.max_page_bytes} bytes)")
        stored = [e for e in map(self._dir.get, keys) if e is not None]
        self._dir.pin(stored)  # making room for later blocks never evicts earlier ones
        slots: list[ReservedSlot] = []
        near = NEAR_DEVICE.set(device)
        try:
            for i, key in enumerate(keys):
                if key in self._dir:
                    continue
                if not await self._placement.make_room(link, slot_bytes, ns.tenant,
                                                       for_slot=True):
                    break
                slot = await tier.allocate_slot(slot_bytes, ns.tenant)
                if slot is None:
                    break
                # An open slot counts against the tenant's share until it is published or freed.
                self._dir.charge(link.name, ns.tenant, slot.slot_bytes)
                slots.append(ReservedSlot(key, i, keys[i - 1] if i else None, link, slot))
        except BaseException:
            self._abort_slots(ns.tenant, slots)
            raise
        finally:
            NEAR_DEVICE.reset(near)
            self._dir.unpin(stored)
        prefix = tuple(keys[:slots[-1].block_index]) if slots else ()
        hold = self._reservations.add(ReservationHold(secrets.token_hex(12), deadline, ns, slots,
                                                      prefix))
        return Reservation(hold.held_id, hold.deadline, link.codec.name,
                           _grants(tier, ns.tenant, slots),
                           sealed=isinstance(tier, CheckedCopies))

    def reserved_keys(self, reservation_id: str) -> list[BlockKey]:
        """The keys an open reservation has slots for ([] if unknown)."""
        hold = self._reservations.get(reservation_id)
        return [] if hold is None else [reserved.key for reserved in hold.slots]

    async def commit(self, reservation_id: str, ready_event: bytes = b"") -> int:
        """Verify every page written into the reservation's slots and publish them; return the
        tokens newly published.

        Host slots (``CheckedCopies``): each page is copied once, where no client can write
        (making room for it first), and every check is made on that copy (``WrittenPage``),
        which is what gets published: a writer that changes its slot during or after the copy
        changes nothing anyone reads unchecked. A page that fails aborts the whole commit and
        frees every slot: nothing half-written, or that would not decode on a later read,
        demotion or transcode, is ever published. A block stored meanwhile by another writer
        keeps that copy and frees this slot. Device slots (``DevicePages``) are published under
        the meta the store builds, once ``ready_event`` (the writer's IPC event handle) fired.
        """
        hold = self._reservations.pop(reservation_id)
        link = hold.slots[0].link if hold.slots else None  # one tier lends all of them
        if link is not None and isinstance(link.tier, DevicePages):
            published = await self._commit_device(hold, ready_event)
        else:
            published = await self._commit_host(hold)
        self._dir.touch(self._dir.match_prefix(published), hit=False)
        written = len(published) * hold.ns.spec.block_tokens
        self._count(hold.ns.tenant, puts=1, put_tokens=written)
        return written

    async def _commit_host(self, hold: ReservationHold) -> list[BlockKey]:
        """``_publish_host`` with the prompt's stored head pinned."""
        if hold.slots and not isinstance(hold.slots[0].link.tier, CheckedCopies):
            self._abort_slots(hold.tenant, hold.slots)
            raise NoSlotTier(f"tier {hold.slots[0].link.name} lends slots it cannot publish")
        stored = [e for e in map(self._dir.get, hold.prefix) if e is not None]
        self._dir.pin(stored)  # making room for these pages never evicts the prompt's head
        try:
            return await self._publish_host(hold)
        finally:
            self._dir.unpin(stored)

    async def _publish_host(self, hold: ReservationHold) -> list[BlockKey]:
        """Claims first (room for each page, its copy and check started in a thread, side by
        side), then every claim checked, and only then any published: all or nothing."""
        claims: list[tuple[ReservedSlot, Any]] = []
        try:
            for reserved in hold.slots:
                claim = None if self._is_stored(reserved) else await self._claim(hold, reserved)
                if claim is not None:
                    claims.append((reserved, claim))
            metas = [await reserved.link.tier.checked(claim)  # type: ignore[attr-defined]
                     for reserved, claim in claims]
        except BaseException:  # a cancelled commit frees its slots too: the hold is gone
            for reserved, claim in claims:
                reserved.link.tier.drop(claim)  # type: ignore[attr-defined]
            self._abort_slots(hold.tenant, hold.slots)
            raise
        checked = {id(reserved): (claim, meta) for (reserved, claim), meta in zip(claims, metas)}
        published: list[BlockKey] = []
        for reserved in hold.slots:
            tier: Any = reserved.link.tier
            claim, meta = checked.get(id(reserved), (None, None))
            if claim is None:  # stored meanwhile, or no room for its page
                tier.abort(reserved.slot)
            elif tier.publish(claim) and reserved.key not in self._dir:
                self._dir.place(meta, reserved.link.name, tier.page_size(reserved.key) or 0,
                                tier.footprint(reserved.key))
                published.append(reserved.key)
            self._dir.charge(reserved.link.name, hold.tenant, -reserved.slot.slot_bytes)
        return published

    async def _commit_device(self, hold: ReservationHold, ready_event: bytes
                             ) -> list[BlockKey]:
        published: list[BlockKey] = []
        for i, reserved in enumerate(hold.slots):
            tier: Any = reserved.link.tier
            try:
                if self._is_stored(reserved):
                    tier.abort(reserved.slot)
                else:
                    meta = self._device_meta(hold.ns, reserved)
                    length = await tier.publish_sections(reserved.slot, reserved.key, meta,
                                                         hold.ns.spec, ready_event)
                    if length:
                        self._dir.place(meta, reserved.link.name, length,
                                        tier.footprint(reserved.key))
                        published.append(reserved.key)
            except BaseException:
                self._abort_slots(hold.tenant, hold.slots[i:])
                raise
            self._dir.charge(reserved.link.name, hold.tenant, -reserved.slot.slot_bytes)
        return published

    def _is_stored(self, reserved: ReservedSlot) -> bool:
        return reserved.key in self._dir or reserved.link.tier.contains(reserved.key)

    async def _claim(self, hold: ReservationHold, reserved: ReservedSlot) -> object | None:
        """Room for one host slot's page, and its copy and check started (None: no room)."""
        tier: Any = reserved.link.tier
        # The header is the writer's: it only sizes the copy (the tier bounds it by the slot),
        # and the check of the copy requires the copied page to be exactly that long.
        nbytes = page_length(tier.slot_view(reserved.slot))
        if not await self._placement.make_room(reserved.link, nbytes, hold.tenant):
            return None
        return await tier.claim(reserved.slot, reserved.key, nbytes,
                                WrittenPage(hold.ns, reserved))

    @staticmethod
    def _device_meta(ns: Namespace, reserved: ReservedSlot) -> PageMeta:
        codec = reserved.link.codec
        return PageMeta(reserved.key, ns.fingerprint, reserved.parent, reserved.block_index,
                        ns.tenant, ns.model_id, codec.name, codec.codec_id)

    def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back without publishing anything."""
        hold = self._reservations.pop(reservation_id)
        self._abort_slots(hold.tenant, hold.slots)

    def _abort_slots(self, tenant: str, slots: list[ReservedSlot]) -> None:
        for reserved in slots:
            reserved.link.tier.abort(reserved.slot)  # type: ignore[attr-defined]
            self._dir.charge(reserved.link.name, tenant, -reserved.slot.slot_bytes)

    # ------------------------------------------------------------------------------ background

    async def reaper(self) -> None:
        """Background: reclaim expired leases (unpin) and reservations (free their slots)."""
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now = time.time()
            for lease in self._leases.expired(now):
                log.info("lease %s expired; unpinning %d blocks", lease.held_id,
                         len(lease.entries))
                self._dir.unpin(lease.entries)
            for reservation in self._reservations.expired(now):
                log.info("reservation %s expired; freeing its slots", reservation.held_id)
                self._abort_slots(reservation.tenant, reservation.slots)


def _locations(tier: SlotTier, keys: list[BlockKey]) -> BlockLocations:
    """Where ``tier`` holds ``keys``, as one table (a lease of 512 blocks builds arrays, not
    512 values)."""
    found = list(map(tier.locate, keys))
    if not found:
        return BlockLocations(b"", tier.medium, [], [], [], [])
    regions, offsets, lengths = zip(*found)
    names = list(dict.fromkeys(regions))  # a device pool's blocks: one region
    if len(names) == 1:
        index: list[int] | np.ndarray = np.zeros(len(found), dtype=np.uint32)
    else:
        number = {name: i for i, name in enumerate(names)}
        index = [number[region] for region in regions]
    return BlockLocations(b"".join(keys), tier.medium, names, index, offsets, lengths)


def _grants(tier: SlotTier, tenant: str, slots: list[ReservedSlot]) -> SlotGrants:
    """The slots of a reservation as one table (in ``tenant``'s regions: one, but for a tier of
    several GPUs whose preferred one was full)."""
    regions = [tier.slot_region(r.slot, tenant) for r in slots]
    names = list(dict.fromkeys(regions))
    number = {name: i for i, name in enumerate(names)}
    return SlotGrants(b"".join([r.key for r in slots]), tier.medium, names,
                      [number[region] for region in regions],
                      [r.slot.offset for r in slots], [r.slot.slot_bytes for r in slots],
                      [r.block_index for r in slots],
                      b"".join([r.parent or bytes(KEY_BYTES) for r in slots]))


class WrittenPage:
    """The commit's check of the page a writer put into its slot for ``reserved``, made on
    the tier's copy of it as the copy lands (``PageCheck``: no client can write the copy), and
    the seal of that copy: every checksum computed there (``PageSeal``), whatever the writer
    left in its slot's.

    Checks the length, header, key, parent, namespace, position, tenant, model and codec name,
    and requires every value of the payload, decoded under the reservation's codec into the
    namespace's shape and dtype, to be finite (a lossy tier's encoder refuses NaN and Inf, so
    such a page could never be demoted): a raw page's K/V on its bits, piece by piece as they
    land, any other decoded at the end. CorruptPage or InvalidArgument names the block.
    Blocking: the tier runs it in a thread.
    """

    __slots__ = ("_checked", "_ns", "_reserved", "_seal", "_section")

    def __init__(self, ns: Namespace, reserved: ReservedSlot) -> None:
        self._ns = ns
        self._reserved = reserved
        self._seal = PageSeal(reserved.key)
        # A raw page's K/V bits (start, end in the page), once its blob header is in; None
        # before, () for a page of another codec (decoded and checked at the end).
        self._section: tuple[int, int] | tuple[()] | None = None
        self._checked = 0

    def feed(self, view: memoryview, copied: int) -> None:
        self._seal.feed(view, copied)
        if self._seal.fields is None:
            return
        if self._section is None:
            self._section = self._raw_section(view, copied)
            if self._section is None:
                return
        if not self._section:
            return
        start, end = self._section
        itemsize = self._ns.spec.torch_dtype.itemsize
        upto = min(copied, end)
        upto -= (upto - start) % itemsize
        if upto > self._checked:
            bits = np.frombuffer(view[self._checked : upto], dtype=f"u{itemsize}")
            if not bits_all_finite(bits, self._ns.spec.torch_dtype):
                raise CorruptPage(f"page for key {self._reserved.key.hex()} decodes to NaN or "
                                  "Inf values")
            self._checked = upto

    def _raw_section(self, view: memoryview, copied: int) -> tuple[int, int] | tuple[()] | None:
        """Where a raw page's K/V lies, once its blob header is copied (None before)."""
        if not isinstance(self._reserved.link.codec, RawCodec):
            return ()
        payload = self._seal.payload_start
        try:
            head = blob_header(view[payload : max(payload, copied)])
        except CodecError as exc:
            raise self._undecodable(exc) from None
        if head is None:
            return None
        codec_id = self._seal.fields[2]  # type: ignore[index]
        if codec_id != RawCodec.codec_id:  # what the page says it is: not what was asked for
            raise InvalidArgument(f"page for key {self._reserved.key.hex()} is encoded with "
                                  f"codec id {codec_id}; the reservation asked for "
                                  f"{self._reserved.link.codec.name!r}")
        spec = self._ns.spec
        shape = spec.shape(spec.block_tokens)
        expected = math.prod(shape) * spec.torch_dtype.itemsize
        if (head.codec_id != RawCodec.codec_id or head.dtype != spec.torch_dtype
                or head.shape != shape or head.section_bytes != (expected,)):
            raise self._undecodable(CodecError(
                f"blob holds codec id {head.codec_id}, {head.shape} {head.dtype} in "
                f"sections of {head.section_bytes} bytes"))
        if payload + head.nbytes != len(view):
            raise self._undecodable(CodecError(
                f"blob of {head.nbytes} bytes in a {len(view) - payload}-byte payload"))
        start = payload + head.header_bytes
        self._checked = start
        return start, start + expected

    def finish(self, out: memoryview) -> PageMeta:
        self._seal.seal(out)
        key, ns, reserved = self._reserved.key, self._ns, self._reserved
        page = parse_page(out.toreadonly(), expected_key=key, is_trusted=True)
        meta = page.meta
        if (meta.namespace != ns.fingerprint or meta.block_index != reserved.block_index
                or meta.parent != reserved.parent):
            raise CorruptPage(f"page for key {key.hex()} names another namespace, position or "
                              "parent")
        if meta.tenant != ns.tenant or meta.model_id != ns.model_id:
            raise CorruptPage(f"page for key {key.hex()} names tenant/model "
                              f"{shown(meta.tenant)}/{shown(meta.model_id)}, reserved for "
                              f"{ns.tenant}/{ns.model_id}")
        codec = reserved.link.codec
        if meta.codec != codec.name:
            raise InvalidArgument(f"page for key {key.hex()} is encoded with "
                                  f"{shown(meta.codec)}; the reservation asked for "
                                  f"{codec.name!r}")
        if self._section == ():
            spec = ns.spec
            try:
                decoded = codec.decode(page.payload, out=torch.empty(
                    spec.shape(spec.block_tokens), dtype=spec.torch_dtype), verify=False)
            except _DECODE_FAILURES as exc:  # a garbage payload is refused, whatever it breaks
                raise self._undecodable(exc) from None
            if not is_all_finite(decoded):
                raise CorruptPage(f"page for key {key.hex()} decodes to NaN or Inf values")
        elif self._section is None or self._checked != self._section[1]:
            raise self._undecodable(CodecError("its blob ends inside its header"))
        return meta

    def _undecodable(self, exc: BaseException) -> CorruptPage:
        spec = self._ns.spec
        return CorruptPage(f"page for key {self._reserved.key.hex()} does not decode as "
                           f"{self._reserved.link.codec.name} K/V of shape "
                           f"{tuple(spec.shape(spec.block_tokens))} {spec.dtype}: {exc}")
