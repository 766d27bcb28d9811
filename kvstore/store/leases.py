"""Leases: a stored prefix pinned, promoted into a tier that lends slots (``SlotTier``), for
zero-copy reads until released or reaped at its deadline."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import numpy as np

from kvstore.api import BlockLocations, Lease, Medium
from kvstore.errors import InvalidArgument, NoSlotTier
from kvstore.keys import BlockKey, Namespace
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.held import HeldTable, LeaseHold
from kvstore.store.placement import Link, Placement
from kvstore.tiers.base import NEAR_DEVICE, SlotTier

log = logging.getLogger("kvstore.leases")

REAPER_INTERVAL_S = 0.25  # how often expired leases and reservations are reclaimed
# Promotions one acquire keeps in flight: SSD reads of 2 MiB pages in worker threads overlap
# (one at a time, a read waits on the disk's latency and nothing else runs on it).
PROMOTE_WINDOW = 16


def lending_link(placement: Placement, medium: Medium) -> Link:
    """The fastest link whose tier lends ``medium`` slots; NoSlotTier if none does."""
    link = placement.slot_link(medium)
    if link is None:
        raise NoSlotTier(f"no tier of this store lends {medium.value} slots for "
                         "zero-copy reads and writes; use put and get")
    return link


class LeaseManager:
    """Grants the store's leases and reclaims them at their deadline.

    Args:
        directory: the store's block directory.
        placement: the store's placement over the chain (promotion).
        held: the record of open leases and reservations.
    """

    def __init__(self, directory: BlockDirectory, placement: Placement, held: HeldTable
                 ) -> None:
        self._dir = directory
        self._placement = placement
        self._held = held

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
        deadline = self._held.deadline(lease_s)
        self._held.check_room(LeaseHold.KIND, ns.tenant)
        link = lending_link(self._placement, medium)
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
        hold = self._held.add(LeaseHold(secrets.token_hex(12), deadline, ns.tenant, held))
        self._dir.touch(held)
        link.leased_pages += len(held)  # reads served from this tier (Inventory.stats)
        link.leased_bytes += sum(entry.sizes.get(link.name, 0) for entry in held)
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
        self._dir.unpin(self._held.pop(lease_id, LeaseHold).entries)

    async def reaper(self) -> None:
        """Background: unpin expired leases."""
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            for lease in self._held.expired(LeaseHold, time.time()):
                log.info("lease %s expired; unpinning %d blocks", lease.held_id,
                         len(lease.entries))
                self._dir.unpin(lease.entries)


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
