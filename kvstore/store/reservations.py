"""Reservations: slots a tier lends for zero-copy writes, published by a checked commit or
given back by an abort or at their deadline."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from kvstore.api import Medium, Reservation, SlotGrants
from kvstore.codecs.base import Codec
from kvstore.errors import CapacityError, NoSlotTier
from kvstore.keys import KEY_BYTES, BlockKey, Namespace
from kvstore.page import HEADER_BYTES, MAX_META_BYTES, PageMeta, page_length
from kvstore.spec import KVSpec
from kvstore.store.directory import BlockDirectory
from kvstore.store.held import HeldTable, ReservationHold, ReservedSlot
from kvstore.store.leases import REAPER_INTERVAL_S, lending_link
from kvstore.store.placement import Count, Placement
from kvstore.store.written import WrittenPage
from kvstore.tiers.base import NEAR_DEVICE, CheckedCopies, DevicePages, SlotTier

log = logging.getLogger("kvstore.leases")


def page_bound(codec: Codec, spec: KVSpec) -> int:
    """Upper bound on the encoded page of one block of ``spec`` under ``codec`` (the slot size a
    zero-copy writer is given)."""
    payload = codec.bytes_per_element(spec) * spec.elements_per_block
    # zstd can expand incompressible data by a few bytes per 128 KiB block plus its frame.
    slack = 64 + spec.block_bytes // 1024 if "zstd" in codec.name else 0
    return HEADER_BYTES + MAX_META_BYTES // 64 + int(payload) + 64 + slack


class Reservations:
    """Grants the store's reservations, publishes or aborts them, and reclaims them at their
    deadline.

    Args:
        directory: the store's block directory.
        placement: the store's placement over the chain (making room).
        held: the record of open leases and reservations.
        count: adds to the store's request counters.
    """

    def __init__(self, directory: BlockDirectory, placement: Placement, held: HeldTable,
                 count: Count) -> None:
        self._dir = directory
        self._placement = placement
        self._held = held
        self._count = count

    async def reserve(self, ns: Namespace, keys: list[BlockKey], lease_s: float | None,
                      medium: Medium = Medium.HOST, device: str = "") -> Reservation:
        """Slots in the fastest slot tier for the blocks of ``keys`` not stored yet (``device``:
        the writer's GPU, where a tier of several GPUs lends them while it has room).

        A reservation claims nothing: a second writer of the same prefix (a put, or another
        reservation) proceeds at once, and whichever publishes a block first keeps it, so a
        writer that died never holds a prefix back until its deadline.
        """
        deadline = self._held.deadline(lease_s)
        self._held.check_room(ReservationHold.KIND, ns.tenant)
        link = lending_link(self._placement, medium)
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
        hold = self._held.add(ReservationHold(secrets.token_hex(12), deadline, ns, slots,
                                              tuple(keys)))
        return Reservation(hold.held_id, hold.deadline, link.codec.name,
                           _grants(tier, ns.tenant, slots),
                           sealed=isinstance(tier, CheckedCopies))

    def reserved_keys(self, reservation_id: str) -> list[BlockKey]:
        """The keys an open reservation has slots for ([] if unknown)."""
        hold = self._held.get(reservation_id, ReservationHold)
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
        hold = self._held.pop(reservation_id, ReservationHold)
        # A commit is a put: its blocks are sighted as a streamed put's are, so the admission
        # filters below treat them alike (zero-copy blocks were dropped on eviction instead of
        # demoted: 38 of 100 kept against 100 of 100 streamed, issue 28).
        self._placement.note(hold.keys)
        link = hold.slots[0].link if hold.slots else None  # one tier lends all of them
        if link is not None and isinstance(link.tier, DevicePages):
            published = await self._commit_device(hold, ready_event)
        else:
            published = await self._commit_host(hold)
        reachable = self._dir.match_prefix(hold.keys)
        self._dir.touch(reachable, hit=False)
        # Only what a lookup reaches counts (a block behind one not published is not).
        reached = set(hold.keys[:len(reachable)])
        written = sum(key in reached for key in published) * hold.ns.spec.block_tokens
        self._count(hold.ns.tenant, puts=1, put_tokens=written)
        return written

    async def _commit_host(self, hold: ReservationHold) -> list[BlockKey]:
        """``_publish_host`` with the prompt's stored head pinned."""
        if hold.slots and not isinstance(hold.slots[0].link.tier, CheckedCopies):
            self._abort_slots(hold.tenant, hold.slots)
            raise NoSlotTier(f"tier {hold.slots[0].link.name} lends slots it cannot publish")
        stored = [e for e in map(self._dir.get, hold.head) if e is not None]
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
                if self._is_stored(reserved):
                    continue
                claim = await self._claim(hold, reserved)
                if claim is None:
                    break  # no room: the blocks behind this one could never be matched
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
        return PageMeta.for_block(ns, reserved.key, reserved.parent, reserved.block_index,
                                  codec)

    def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back without publishing anything."""
        hold = self._held.pop(reservation_id, ReservationHold)
        self._abort_slots(hold.tenant, hold.slots)

    def _abort_slots(self, tenant: str, slots: list[ReservedSlot]) -> None:
        for reserved in slots:
            reserved.link.tier.abort(reserved.slot)  # type: ignore[attr-defined]
            self._dir.charge(reserved.link.name, tenant, -reserved.slot.slot_bytes)


    async def reaper(self) -> None:
        """Background: free the slots of expired reservations."""
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            for reservation in self._held.expired(ReservationHold, time.time()):
                log.info("reservation %s expired; freeing its slots", reservation.held_id)
                self._abort_slots(reservation.tenant, reservation.slots)


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

