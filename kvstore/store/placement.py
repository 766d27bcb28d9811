"""Placement over the tier chain: write new blocks, make room, demote, promote, transcode.

The chain is an ordered list of ``Link``s, fastest first, built from config. Nothing here names
a tier: a link is a position, a tier object and that tier's codec, admission policy and
watermarks. The rules:

- A new block goes to the fastest tier that can make room for it (``store_new``).
- Making room in a tier is atomic: the tier says what it needs for the tenant whose page is
  coming (``Tier.room_for_tenant``: bytes of a class, whose blocks, or exactly which blocks),
  the tier's eviction order names victims that free exactly that, or nothing changes. Pinned blocks are
  never victims; a put pins the blocks it holds so it never evicts its own.
- A victim is demoted to the next tier down that admits it (``AdmissionPolicy``) and can make
  room for it, unless a faster tier still holds the block or the walk down reaches a tier that
  does (a copy further down does not serve as fast as the tier in between); a block that no
  lower tier takes is dropped.
- A tier above its high watermark demotes its coldest blocks until it is below its low one;
  a block no lower tier takes stays until room is needed (dropping it early gains nothing).
- Promotion copies a block into a faster tier (after a get served it from further down, for a
  lease, or for a hint); a tier with ``write_through`` set also gets a copy of every new block,
  in the background (``kvstore.store.write_through``: bounded queues that drop, not stall). A put's copy of a block held only further down is written into a faster
  tier whose admission ``lifts`` it (``lift``: the engine recomputed it instead of fetching it).
- A shared tier (``SharedTier``, last in the chain) is written like any other, by demotion or
  write-through; blocks other hosts put there are found by the store's prefix probe, not the
  directory (the store does not own what a shared tier holds).
- Pages move between tiers re-encoded with the target tier's codec (``transcode``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvstore import codecs
from kvstore.api import Medium
from kvstore.codecs.base import Codec
from kvstore.config import TierConfig, TierSettings
from kvstore.errors import CapacityError, KVStoreError, shown
from kvstore.keys import BlockKey
from kvstore.page import Page, PageMeta, PendingPage, decode_page, encode_page, finished_page
from kvstore.policy.admission import admission_for
from kvstore.policy.base import AdmissionPolicy
from kvstore.policy.cost import PathModel
from kvstore.room import RoomNeed
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.tiers import build_tier
from kvstore.tiers.base import InPlaceWrites, SharedTier, SlotTier, Tier

log = logging.getLogger("kvstore.store")

# A log-structured tier frees deleted bytes only once compaction rewrites their segment, so a
# write after making room may find the tier still short; this bounds the rounds of evicting.
MAX_ROOM_ROUNDS = 4


@dataclass(slots=True)
class Link:
    """One tier of the chain, with what the store keeps beside it."""

    index: int  # position in the chain, 0 = fastest
    name: str
    tier: Tier
    codec: Codec
    settings: TierSettings
    admission: AdmissionPolicy
    path: PathModel  # the cost model's estimate of reading out of this tier
    evictions: int = 0  # pages removed from this tier to make room (demoted or dropped)
    # Pages leased out of this tier and their bytes: clients read those in place, past the
    # tier's own read path, so the tier never counts them; its stats add these.
    leased_pages: int = 0
    leased_bytes: int = 0

    @classmethod
    def build(cls, index: int, config: TierConfig) -> Link:
        settings = config.settings
        return cls(index=index, name=config.name, tier=build_tier(config),
                   codec=codecs.get(settings.codec), settings=settings,
                   admission=admission_for(settings.admit_after_accesses,
                                           settings.admit_expected_keys, settings.eviction),
                   path=PathModel(settings.read_bytes_per_s, settings.read_fixed_s))

    def is_above_high_watermark(self) -> bool:
        return self.tier.used_bytes > self.settings.high_watermark * self.tier.capacity_bytes


Count = Callable[..., None]  # count(tenant, **deltas) adds to the store's request counters


class Placement:
    """Moves blocks between the links of one chain and keeps the directory in step.

    Called only from the store's event loop; codec work goes to threads.
    """

    def __init__(self, links: Sequence[Link], directory: BlockDirectory, count: Count,
                 tenant_share: float | None = None) -> None:
        self.links = list(links)
        self.by_name = {link.name: link for link in self.links}
        self._dir = directory
        self._count = count
        self._share = tenant_share  # fraction of each tier a tenant may fill; None: no quotas

    # ------------------------------------------------------------------------------ queries

    def fastest_holder(self, entry: BlockEntry) -> Link:
        sizes = entry.sizes
        for link in self.links:
            if link.name in sizes:
                return link
        raise KeyError(f"block {entry.meta.key.hex()} is in no tier of the chain")

    def slot_link(self, medium: Medium = Medium.HOST) -> Link | None:
        """The fastest tier that lends slots of ``medium`` (zero-copy writes and pinned reads),
        if any."""
        return next((link for link in self.links if isinstance(link.tier, SlotTier)
                     and link.tier.medium is medium), None)

    def shared_link(self) -> Link | None:
        """The tier several hosts share, if the chain has one."""
        return next((link for link in self.links if isinstance(link.tier, SharedTier)), None)

    def write_through_links(self) -> list[Link]:
        """Tiers below the first that get a copy of every new block."""
        return [link for link in self.links[1:] if link.settings.write_through]

    def quota_bytes(self, link: Link) -> int | None:
        """Bytes of ``link``'s tier one tenant may fill, or None when quotas are off."""
        return None if self._share is None else int(self._share * link.tier.capacity_bytes)

    def note(self, keys: Sequence[BlockKey]) -> None:
        """Sightings of a prefix's blocks, for every tier's admission policy."""
        for link in self.links:
            link.admission.note(keys)

    # ------------------------------------------------------------------------------ writes

    async def store_new(self, meta: PageMeta, data: bytes | memoryview | PendingPage
                        ) -> BlockEntry:
        """Place a page encoded with the first tier's codec (or to be framed where it goes: a
        ``PendingPage``) in the fastest tier that takes it.

        New blocks skip admission: a tier's filter only decides what moves down into it.
        Raises CapacityError, naming sizes, when no tier can hold the page.
        """
        for link in self.links:
            page = await self.transcode(meta, data, link)
            if page is not None and await self.write(link, meta, page):
                return self._dir.get(meta.key)
        sizes = ", ".join(f"{link.name} {link.tier.max_page_bytes} bytes" for link in self.links)
        share = "" if self._share is None else (
            f"; tenant {shown(meta.tenant)} may fill {self._share:.0%} of each tier")
        raise CapacityError(f"no tier can hold the {len(data)}-byte page of block "
                            f"{meta.key.hex()} now (largest page per tier: {sizes}{share})")

    async def write(self, link: Link, meta: PageMeta, data: bytes | memoryview | PendingPage
                    ) -> bool:
        """Make room in ``link``'s tier and write the page; record the placement on success.

        A page larger than the tier could ever hold is refused without evicting anything. A
        pending page is framed in place by a tier that can (``InPlaceWrites``), else framed
        into a buffer first.
        """
        if len(data) > link.tier.max_page_bytes:
            return False
        in_place = isinstance(data, PendingPage) and isinstance(link.tier, InPlaceWrites)
        for _ in range(MAX_ROOM_ROUNDS):
            if not await self.make_room(link, len(data), meta.tenant):
                return False
            if in_place:
                written = await link.tier.write_pending(meta.key, data)
            else:
                written = await link.tier.write(meta.key, finished_page(data), meta)
            for moved in link.tier.moved_keys():
                self._dir.refile(link.name, moved, link.tier.footprint(moved))
            if written:
                footprint = link.tier.footprint(meta.key)
                if footprint is None:  # deleted while the write finished: not placed
                    return False
                self._dir.place(meta, link.name, len(data), footprint)
                return True
        return False

    async def make_room(self, link: Link, nbytes: int, tenant: str, for_slot: bool = False
                        ) -> bool:
        """Free what ``link``'s tier needs for ``tenant``'s page of ``nbytes`` (``for_slot``: for
        a slot its ``allocate_slot`` lends): True if it fits.

        Atomic: victims are chosen only if together they free enough, and only blocks whose
        removal frees room for this size; otherwise nothing is evicted. With quotas, a tenant
        at its share gives up its own blocks first, and the tier makes room only from that
        tenant's blocks or from tenants above their share: nobody flushes a tenant within its
        share.
        """
        quota = self.quota_bytes(link)
        is_protected = self._dir.is_protected
        # Memory of a tenant's that the tier gave back but could not free yet is the tenant's:
        # charged to its share, it cannot grow past it again and leave others less. (Asked at
        # every room-making, also without quotas: the tier looks whether it is freed since.)
        outside = await link.tier.held_outside()
        if quota is not None:
            if nbytes > quota:
                return False
            over = self._dir.usage(link.name, tenant) + outside.get(tenant, 0) + nbytes - quota
            own = self._not_owned_by(tenant)
            if over > 0 and not await self._evict(link, RoomNeed(over), own):
                return False
            is_protected = self._fair_game_for(tenant, link.name, quota, outside)
        room = link.tier.room_for_slot if for_slot else link.tier.room_for_tenant
        need = room(nbytes, tenant, is_protected)
        if need is not None and not await self._evict(link, need, is_protected):
            return False
        return room(nbytes, tenant, is_protected) is None

    async def _evict(self, link: Link, need: RoomNeed, is_protected: Callable[[BlockKey], bool]
                     ) -> bool:
        """Give up what ``need`` names (its tenant's blocks only, or exactly its keys), all of
        it or nothing."""
        if need.tenant is not None:
            is_protected = self._owned_by(need.tenant, is_protected)
        if need.keys is not None:
            victims = None if any(map(is_protected, need.keys)) else list(need.keys)
        else:
            victims = self._dir.victims(link.name, need, is_protected)
        if victims is None:
            return False
        for key in victims:
            await self.give_up(link, key)
        return True

    def _owned_by(self, tenant: str, is_protected: Callable[[BlockKey], bool]
                  ) -> Callable[[BlockKey], bool]:
        def protected(key: BlockKey) -> bool:
            return self._dir.owner(key) != tenant or is_protected(key)

        return protected

    def _not_owned_by(self, tenant: str) -> Callable[[BlockKey], bool]:
        def is_protected(key: BlockKey) -> bool:
            return self._dir.is_protected(key) or self._dir.owner(key) != tenant

        return is_protected

    def _fair_game_for(self, tenant: str, tier: str, quota: int, outside: dict[str, int]
                       ) -> Callable[[BlockKey], bool]:
        def is_protected(key: BlockKey) -> bool:
            if self._dir.is_protected(key):
                return True
            owner = self._dir.owner(key)
            return (owner != tenant
                    and self._dir.usage(tier, owner) + outside.get(owner, 0) <= quota)

        return is_protected

    async def give_up(self, link: Link, key: BlockKey, may_drop: bool = True) -> None:
        """Remove ``key`` from ``link``'s tier, demoting it first if no other tier holds it
        (``may_drop`` False: keep it where it is if no lower tier takes it)."""
        entry = self._dir.get(key)
        if entry is None or entry.pins or link.name not in entry.sizes:
            return
        if entry.live and not any(faster.name in entry.sizes
                                  for faster in self.links[:link.index]):
            self._dir.pin([entry])  # the page must outlive its copy down the chain
            try:
                demoted = await self.demote(link, entry)
                if demoted:
                    self._count(entry.meta.tenant, demotions=1)
            finally:
                self._dir.unpin([entry])
            if entry.pins or not (demoted or may_drop):
                return  # a reader arrived while it was copied, or it stays: keep this copy
        if self._dir.get(key) is not entry or link.name not in entry.sizes:
            return
        await link.tier.delete(key)
        link.evictions += 1
        if self._dir.unplace(key, link.name) is None:
            self._count(entry.meta.tenant, dropped=1)

    async def demote(self, link: Link, entry: BlockEntry) -> bool:
        """Copy the block to the next tier below ``link`` that admits it and has room."""
        page = None
        for lower in self.links[link.index + 1:]:
            if lower.name in entry.sizes:
                return True
            if not lower.admission.admits(entry.meta.key):
                continue
            if page is None:
                page = await link.tier.read(entry.meta.key)
                if page is None:  # corrupt or lost: the tier dropped it
                    self._dir.unplace(entry.meta.key, link.name)
                    return False
            data = await self.transcode(entry.meta, page.data, lower)
            if data is not None and await self.write(lower, entry.meta, data):
                return True
        return False

    def lift_target(self, entry: BlockEntry) -> Link | None:
        """The fastest tier above the block's fastest holder whose admission takes a put's copy
        of it (``AdmissionPolicy.lifts``), or None."""
        holder = self.fastest_holder(entry)
        return next((link for link in self.links[:holder.index]
                     if link.admission.lifts(entry.meta.key)), None)

    async def lift(self, entry: BlockEntry, data: bytes | memoryview) -> bool:
        """Write a put's page of a block held only further down (encoded with the first tier's
        codec) into the faster tiers that lift it, fastest first; True once one holds it."""
        holder = self.fastest_holder(entry)
        for link in self.links[:holder.index]:
            if not link.admission.lifts(entry.meta.key):
                continue
            page = await self.transcode(entry.meta, data, link)
            if page is not None and await self.write(link, entry.meta, page):
                self._count(entry.meta.tenant, promotions=1)
                return True
        return False

    async def promote(self, entry: BlockEntry, target: Link) -> bool:
        """Copy a block into ``target`` from the fastest tier holding it; True if it is in
        ``target`` afterwards."""
        if target.name in entry.sizes:  # already there: nothing moved, nothing to count
            return True
        ok = await self.copy(entry, target)
        if ok:
            self._count(entry.meta.tenant, promotions=1)
        return ok

    async def copy(self, entry: BlockEntry, target: Link) -> bool:
        """Copy a block into ``target`` from the fastest tier holding it; True if it is in
        ``target`` afterwards."""
        key = entry.meta.key
        if target.name in entry.sizes:
            return True
        if self._dir.get(key) is not entry or not entry.live:
            return False
        self._dir.pin([entry])
        try:
            page, _ = await self.read(entry)
            if page is None:
                return False
            data = await self.transcode(entry.meta, page.data, target)
            if data is None:
                return False
            if target.name in entry.sizes:  # another promotion won the race
                return True
            # Evict leaves pinned blocks alone, but a block can still go while it is read (its
            # last other copy found corrupt): then nothing is written.
            if self._dir.get(key) is not entry:
                return False
            ok = await self.write(target, entry.meta, data)  # the source stays pinned till then
            if ok and self._dir.get(key) is not entry:
                # Gone while it was written: the copy must not bring the block back.
                await target.tier.delete(key)
                self._dir.unplace(key, target.name)
                ok = False
        finally:
            self._dir.unpin([entry])
        return ok

    # ------------------------------------------------------------------------------ reads

    async def read(self, entry: BlockEntry, verify: bool = True
                   ) -> tuple[Page | None, Link | None]:
        """The page from the fastest tier holding it (forgetting copies that are gone)."""
        for link in self.links:
            if link.name not in entry.sizes:
                continue
            page = await link.tier.read(entry.meta.key, verify=verify)
            if page is not None:
                return page, link
            self._dir.unplace(entry.meta.key, link.name)  # corrupt or lost: forget this copy
        return None, None

    async def transcode(self, meta: PageMeta, data: bytes | memoryview | PendingPage,
                        target: Link) -> bytes | memoryview | PendingPage | None:
        """The page re-encoded with ``target``'s codec (unchanged if it already matches), or
        None when it cannot be (K/V the codec refuses, such as NaN for a lossy one): the failure
        stays with this block, which simply does not move there, and never reaches the
        request or the demotion that moved it."""
        codec = target.codec
        if meta.codec == codec.name:
            return data

        def work() -> bytes | memoryview:
            kv = codecs.decode(decode_page(finished_page(data)).payload)
            if kv.dtype == torch.uint8 and not codec.lossless:
                # A cache group's bytes (fp8 engine pages, states: kvstore.groups) keep the
                # lossless encoding they were written with; lossy codecs never take them.
                return finished_page(data)
            new_meta = dataclasses.replace(meta, codec=codec.name, codec_id=codec.codec_id)
            return encode_page(new_meta, codec.encode(kv))

        try:
            return await asyncio.to_thread(work)
        except KVStoreError as exc:
            log.warning("block %s cannot be re-encoded for tier %s (%s): %s",
                        meta.key.hex(), target.name, codec.name, exc)
            return None

    # ------------------------------------------------------------------------------ background

    async def demote_above_watermarks(self) -> None:
        """Every tier above its high watermark moves its coldest blocks down the chain until it
        is below its low one.

        Only blocks a lower tier takes move; the rest stay until room is needed. Dropping a
        block frees room at once, so doing it ahead of need gains no headroom and only loses
        hits: it dropped the tail of a put that had just filled the tier (the filter below
        refuses blocks seen once), leaving its lookup short of what the put reported and the
        put's blocks further down unreachable (issue 28).
        """
        for link in self.links[:-1]:
            if not link.is_above_high_watermark():
                continue
            target = link.settings.low_watermark * link.tier.capacity_bytes
            excess = int(link.tier.used_bytes - target)
            try:
                for key in self._movable(link, self._dir.coldest(link.name, excess)):
                    if link.tier.used_bytes <= target:
                        break
                    await self.give_up(link, key, may_drop=False)
            except KVStoreError:
                log.exception("demotion from %s failed; will retry on the next write", link.name)

    def _movable(self, link: Link, keys: list[BlockKey]) -> list[BlockKey]:
        """The blocks of ``keys`` that a tier below ``link`` holds or admits (one pass of each
        lower tier's filter: a tier that stays above its watermark asks again at every write)."""
        movable = [False] * len(keys)
        for lower in self.links[link.index + 1:]:
            admitted = lower.admission.admits_many(keys)
            for i, key in enumerate(keys):
                entry = self._dir.get(key)
                movable[i] = movable[i] or admitted[i] or (
                    entry is not None and lower.name in entry.sizes)
        return [key for key, ok in zip(keys, movable) if ok]

    async def persist(self) -> int:
        """Write every block held only by non-persistent tiers to the first persistent tier
        that asks for it (``persist_on_close``), parents first; return how many were saved."""
        target = next((link for link in self.links
                       if link.tier.is_persistent and link.settings.persist_on_close), None)
        if target is None:
            return 0
        saved = 0
        for entry in sorted(self._dir.entries(), key=lambda e: e.meta.block_index):
            if any(self.by_name[name].tier.is_persistent for name in entry.sizes):
                continue
            page, _ = await self.read(entry)
            if page is None:
                continue
            data = await self.transcode(entry.meta, page.data, target)
            if data is None:
                continue
            try:
                saved += await self.write(target, entry.meta, data)
            except KVStoreError as exc:
                log.warning("could not persist block %s: %s", entry.meta.key.hex(), exc)
        return saved
