"""The operator's view of the store: request counters, stats per tier and tenant, the block
listing, and eviction on request."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from kvstore.api import BlockInfo, Counters, StoreStats, TierStats
from kvstore.errors import InvalidArgument, shown
from kvstore.keys import BlockKey
from kvstore.store.directory import BlockDirectory, BlockEntry
from kvstore.store.held import HeldTable, LeaseHold, ReservationHold
from kvstore.store.placement import Link


class Inventory:
    """Counts the store's requests and answers ``stats``, ``list_blocks`` and ``evict``.

    Args:
        links: the tier chain, fastest first.
        directory: the store's block directory.
        held: the record of open leases and reservations.
    """

    def __init__(self, links: Sequence[Link], directory: BlockDirectory, held: HeldTable
                 ) -> None:
        self._links = links
        self._tiers = {link.name: link.tier for link in links}
        self._dir = directory
        self._held = held
        self._totals = Counters()
        self._by_tenant: dict[str, Counters] = {}
        self._doomed: list[BlockEntry] = []  # invalidated, hidden, deleted once unpinned

    def count(self, tenant: str, **deltas: int) -> None:
        """Add ``deltas`` to the store's counters and ``tenant``'s."""
        self._totals.add(**deltas)
        self._by_tenant.setdefault(tenant, Counters()).add(**deltas)

    async def evict(self, *, tenant: str | None = None, model_id: str | None = None,
                    keys: Sequence[BlockKey] | None = None, everything: bool = False,
                    namespaces: set[bytes] | None = None,
                    unpin: Callable[[list[BlockEntry]], object] | None = None) -> int:
        """Remove matching unpinned blocks from every tier, children first; return the count.

        ``namespaces`` (fingerprints) makes it an invalidation: the matching blocks go even
        when pinned. ``unpin`` ends their TTL pins first; a block a lease or read still holds
        is hidden at once (no lookup, get or lease sees it once this returns) and deleted when
        released (``sweep``); it is counted as removed.
        """
        if not (everything or tenant or model_id or keys or namespaces is not None):
            raise InvalidArgument("evict needs tenant, model_id, keys, a namespace filter or "
                                  "everything=True")
        invalidate = namespaces is not None
        wanted = set(keys) if keys is not None else None
        chosen = [
            e for e in self._dir.entries()
            if (e.pins == 0 or invalidate)
            and (tenant is None or e.meta.tenant == tenant)
            and (model_id is None or e.meta.model_id == model_id)
            and (wanted is None or e.meta.key in wanted)
            and (namespaces is None or e.meta.namespace in namespaces)
        ]
        chosen.sort(key=lambda e: -e.meta.block_index)
        if invalidate and unpin is not None:
            unpin(chosen)
        removed = 0
        for entry in chosen:
            # Earlier deletes awaited: a lease, read or promotion may have pinned it since.
            # Once taken, nobody starts reading it (BlockEntry.live) while its copies go.
            if not self._dir.take_for_eviction(entry):
                if invalidate and self._dir.take_for_eviction(entry, pinned_ok=True):
                    self._doomed.append(entry)
                    removed += 1
                continue
            removed += await self._delete_taken(entry)
        return removed

    async def _delete_taken(self, entry: BlockEntry) -> bool:
        """Delete every copy of an entry taken for eviction; True if it is gone."""
        try:
            for name in list(entry.sizes):
                await self._tiers[name].delete(entry.meta.key)
                self._dir.unplace(entry.meta.key, name)
        finally:
            gone = self._dir.end_eviction(entry)
        return gone

    async def sweep(self) -> None:
        """Delete the invalidated blocks whose last lease or read has ended."""
        if not self._doomed:
            return
        ready = [e for e in self._doomed if e.pins == 0]
        self._doomed = [e for e in self._doomed if e.pins]
        for entry in ready:
            await self._delete_taken(entry)

    def stats(self, tenant: str | None = None) -> StoreStats:
        """Counters per tier and per request type; with ``tenant``, only that tenant's blocks."""
        if tenant is None:
            tiers = {}
            for link in self._links:
                tiers[link.name] = stats = link.tier.stats()
                stats.evictions = link.evictions
                # Leased pages are read by clients in place, never through the tier's read.
                stats.hits += link.leased_pages
                stats.bytes_read += link.leased_bytes
                # The cost model's current estimate of reading out of this tier.
                stats.extra["read_bytes_per_s"] = link.path.bytes_per_s
                stats.extra["read_fixed_s"] = link.path.fixed_s
            return StoreStats(
                tiers=tiers, counters=dataclasses.replace(self._totals),
                active_leases=self._held.count(LeaseHold.KIND),
                active_reservations=self._held.count(ReservationHold.KIND),
                num_blocks=len(self._dir),
            )
        tiers = {name: TierStats(name=name, capacity_bytes=t.capacity_bytes)
                 for name, t in self._tiers.items()}
        num_blocks = 0
        for entry in self._dir.entries():
            if entry.meta.tenant != tenant:
                continue
            num_blocks += 1
            for name, nbytes in entry.sizes.items():
                tiers[name].used_bytes += nbytes
                tiers[name].num_blocks += 1
                tiers[name].hits += entry.hits
        counters = dataclasses.replace(self._by_tenant.get(tenant, Counters()))
        return StoreStats(tiers=tiers, counters=counters, num_blocks=num_blocks)

    def list_blocks(self, *, tenant: str | None = None, model_id: str | None = None,
                    tier: str | None = None, limit: int = 1000) -> list[BlockInfo]:
        """Stored blocks matching the filters, most recently used first."""
        if tier is not None and tier not in self._tiers:
            raise InvalidArgument(f"unknown tier {shown(tier)}; tiers are {list(self._tiers)}")
        if limit < 0:
            raise InvalidArgument(f"limit must be >= 0, got {limit}")
        now = time.time()
        rows = [
            self._dir.info(e, now) for e in self._dir.entries()
            if (tenant is None or e.meta.tenant == tenant)
            and (model_id is None or e.meta.model_id == model_id)
            and (tier is None or tier in e.sizes)
        ]
        rows.sort(key=lambda r: r.age_s)
        return rows[:limit]
