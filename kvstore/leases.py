"""Leases (pinned zero-copy reads), reservations (zero-copy writes) and prefetch hints."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvstore.api import MAX_LEASE_S, BlockLocation, Lease, Medium, Reservation, SlotGrant
from kvstore.errors import CorruptPage, InvalidArgument, KVStoreError, shown
from kvstore.index import BlockEntry, HeldTable
from kvstore.keys import BlockKey, Namespace, block_keys, token_array
from kvstore.page import PageMeta, decode_page

if TYPE_CHECKING:
    from kvstore.store import Store

log = logging.getLogger("kvstore.leases")

REAPER_INTERVAL_S = 0.25  # how often expired leases and reservations are reclaimed


class LeaseManager:
    """Owns the store's leases and reservations and reclaims them at their deadline."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._leases = HeldTable("lease")
        self._reservations = HeldTable("reservation")

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def _lease_s(self, lease_s: float | None) -> float:
        if lease_s is None:
            return self._store.config.server.lease_timeout_s
        if not 0 < lease_s <= MAX_LEASE_S:
            raise InvalidArgument(f"lease_s must be in (0, {MAX_LEASE_S}], got {lease_s}")
        return lease_s

    async def acquire(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor,
                      lease_s: float | None) -> Lease:
        """Pin the stored prefix of ``tokens`` in DRAM (promoting from SSD) under a lease."""
        lease_s = self._lease_s(lease_s)
        store = self._store
        entries = store._dir.match_prefix(block_keys(ns, token_array(tokens)))
        store._dir.pin(entries)
        held: list[BlockEntry] = []
        try:
            for entry in entries:
                if not await store.promote(entry):
                    break
                held.append(entry)
        finally:
            store._dir.unpin(entries[len(held):])
        blocks = []
        for entry in held:
            offset, length = store.dram.locate(entry.meta.key)
            blocks.append(BlockLocation(entry.meta.key, Medium.HOST, store.dram.arena_path, offset,
                                        length))
        holding = self._leases.add(held, lease_s)
        store._dir.touch(held)
        return Lease(holding.held_id, holding.deadline, len(held) * ns.spec.block_tokens,
                     tuple(blocks))

    def release(self, lease_id: str) -> None:
        self._store._dir.unpin(self._leases.pop(lease_id).entries)

    async def reserve(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor,
                      lease_s: float | None) -> Reservation:
        """DRAM slots for the blocks of ``tokens`` that are not stored yet."""
        lease_s = self._lease_s(lease_s)
        store = self._store
        keys = block_keys(ns, token_array(tokens))
        codec = store._codecs["dram"]
        slot_bytes = store.dram_page_bound(ns.spec)
        grants = []
        slots = []
        try:
            for i, key in enumerate(keys):
                if key in store._dir or key in store._writing:
                    continue
                if not await store._make_room("dram", slot_bytes):
                    break
                slot = await store.dram.allocate_slot(slot_bytes)
                if slot is None:
                    break
                slots.append((key, i, slot))
                store.claim_writes([key])
                grants.append(SlotGrant(key, i, keys[i - 1] if i else None, Medium.HOST,
                                        store.dram.arena_path, slot.offset, slot.slot_bytes))
        except BaseException:
            self._abort_slots(slots)
            raise
        holding = self._reservations.add([], lease_s, payload=(ns, slots))
        return Reservation(holding.held_id, holding.deadline, codec.name, tuple(grants))

    async def commit(self, reservation_id: str) -> int:
        """Verify every page written into the reservation's slots and publish them.

        A page that fails verification (or names the wrong key, parent or namespace) aborts the
        whole commit with CorruptPage and frees every slot: nothing half-written is served.
        """
        holding = self._reservations.pop(reservation_id)
        ns, slots = holding.payload
        store = self._store
        try:
            metas = [self._verify_slot(ns, key, index, slot) for key, index, slot in slots]
            for meta in metas:
                if meta.codec != store._codecs["dram"].name:
                    raise InvalidArgument(
                        f"page for key {meta.key.hex()} is encoded with {shown(meta.codec)}; the "
                        f"reservation asked for {store._codecs['dram'].name!r}")
        except KVStoreError:
            self._abort_slots(slots)
            raise
        for (key, _, slot), meta in zip(slots, metas):
            length = store.dram.publish(slot, key, meta)
            store._dir.place(meta, "dram", length)
            store.release_writes([key])
        store._dir.touch(store._dir.match_prefix(k for k, _, _ in slots), hit=False)
        store._wake_demoter()
        written = len(slots) * ns.spec.block_tokens
        store._count(ns.tenant, puts=1, put_tokens=written)
        return written

    def abort(self, reservation_id: str) -> None:
        """Give a reservation's slots back without publishing anything."""
        self._abort_slots(self._reservations.pop(reservation_id).payload[1])

    def _verify_slot(self, ns: Namespace, key: BlockKey, index: int, slot) -> PageMeta:
        page = decode_page(self._store.dram.slot_view(slot), expected_key=key)
        meta = page.meta
        if meta.namespace != ns.fingerprint or meta.block_index != index:
            raise CorruptPage(f"page for key {key.hex()} names another namespace or position")
        if meta.tenant != ns.tenant or meta.model_id != ns.model_id:
            raise CorruptPage(f"page for key {key.hex()} names tenant/model "
                              f"{shown(meta.tenant)}/{shown(meta.model_id)}, reserved for "
                              f"{ns.tenant}/{ns.model_id}")
        return meta

    def _abort_slots(self, slots) -> None:
        for key, _, slot in slots:
            self._store.dram.abort(slot)
            self._store.release_writes([key])

    def hint(self, ns: Namespace, tokens: Sequence[int] | torch.Tensor, deadline_s: float) -> int:
        """Start promoting SSD-only blocks of the prefix now; return how many were scheduled."""
        if deadline_s <= 0:
            raise InvalidArgument(f"deadline_s must be > 0, got {deadline_s}")
        store = self._store
        entries = store._dir.match_prefix(block_keys(ns, token_array(tokens)))
        todo = [e for e in entries if "dram" not in e.sizes]
        for entry in todo:
            store._spawn(asyncio.wait_for(store.promote(entry), timeout=deadline_s))
        return len(todo)

    async def reaper(self) -> None:
        """Background: reclaim expired leases (unpin) and reservations (free their slots)."""
        while True:
            await asyncio.sleep(REAPER_INTERVAL_S)
            now = time.time()
            for holding in self._leases.expired(now):
                log.info("lease %s expired; unpinning %d blocks", holding.held_id,
                         len(holding.entries))
                self._store._dir.unpin(holding.entries)
            for holding in self._reservations.expired(now):
                log.info("reservation %s expired; freeing its slots", holding.held_id)
                self._abort_slots(holding.payload[1])

