"""The block directory: key -> placements, pins and per-block counters; one eviction order per
tier.

The directory is the store's single source of truth about which tier holds which block. It is
touched only from the store's event loop, so it needs no locks. Tiers are names here, as the
chain gave them: the directory never knows what a tier is.

A touch (a chain was used) reaches the eviction orders and the blocks' hit counters on the
loop's next turn, after the request that made it has answered, or before anything reads or
changes an order or reads the counters, whichever comes first: no decision ever sees an order
without it, and a 32k-token lookup does not wait for 2048 re-rankings per tier. A long chain
goes in pieces of ``TOUCH_SLICE_BLOCKS``, its tail first, about a piece a turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat, takewhile
from operator import attrgetter

from kvstore.api import BlockInfo
from kvstore.keys import BlockKey
from kvstore.page import PageMeta
from kvstore.policy.base import EvictionOrder
from kvstore.policy.lru import LruOrder
from kvstore.room import Footprint, RoomNeed

# A piece of a chain used: its keys and entries (the whole chain's), the piece's bounds in
# them, the namespace, and whether it counts as a hit.
_Touch = tuple[Sequence[BlockKey], Sequence["BlockEntry"], int, int, bytes | None, bool]

# Blocks of a chain one loop turn re-ranks: a turn of 8,192 took 5-6.6 ms (hit counters and
# the LRU order of one tier, 2-core box, 2026-12-05), and one of 4,096 3.7-5.4 ms of the loop
# thread's CPU time under the fairness bench, so a piece of 2,048 holds the loop near 2 ms.
TOUCH_SLICE_BLOCKS = 2048


@dataclass(slots=True, eq=False)  # compared by identity: C code scans lists of entries
class BlockEntry:
    """What the store knows about one block."""

    meta: PageMeta
    sizes: dict[str, int] = field(default_factory=dict)  # tier name -> page bytes there
    pins: int = 0  # readers, writers and leases holding it; a pinned block is never evicted
    hits: int = 0
    created_s: float = field(default_factory=time.time)
    fastest: str = ""  # the first tier of the chain that holds it (kept by the directory)
    # False once evict took it (unpinned then): no new lease, read, promotion, demotion or
    # lift starts on it, so evict deletes its copies with no reader appearing between.
    live: bool = True

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(self.sizes)


_FASTEST = attrgetter("fastest")
_LIVE = attrgetter("live")


class _NotStored:
    """What ``match_prefix`` probes a missing key as: not live, like an entry being evicted."""

    live = False


_NOT_STORED = _NotStored()


class BlockDirectory:
    """Placements of every block, one eviction order per tier.

    Args:
        tier_names: the chain's tiers, fastest first.
        order_factory: makes the eviction order of the tier of the name it is given.
        observer: told ``(meta, tier, is_held)`` whenever a tier gains or loses a block (the
            store publishes this host's holdings to a shared tier's directory with it).
    """

    def __init__(self, tier_names: Sequence[str],
                 order_factory: Callable[[str], EvictionOrder] = lambda _: LruOrder(),
                 observer: Callable[[PageMeta, str, bool], None] | None = None) -> None:
        self._observer = observer
        self._entries: dict[BlockKey, BlockEntry] = {}
        self._orders = {name: order_factory(name) for name in tier_names}
        self._rank = {name: i for i, name in enumerate(tier_names)}  # chain position
        # Bytes each tenant is charged in each tier: its blocks' footprints and open slots.
        self._usage: dict[str, dict[str, int]] = {name: {} for name in tier_names}
        # Pieces of chains used and not yet applied to the orders, oldest first (see the
        # module doc): (keys, entries, start, stop, namespace, whether it counts as a hit).
        self._touches: list[_Touch] = []
        self._evicting = 0  # entries evict has taken and not finished with
        self._applying = False  # a turn of _apply_some is scheduled

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The chain's tiers, fastest first."""
        return tuple(self._rank)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: BlockKey) -> BlockEntry | None:
        return self._entries.get(key)

    def entries(self) -> Iterator[BlockEntry]:
        self.apply_touches()  # the entries' hit counters are read from here
        return iter(list(self._entries.values()))

    def place(self, meta: PageMeta, tier: str, nbytes: int, footprint: Footprint) -> BlockEntry:
        """Record that ``tier`` now holds the block, taking ``footprint`` of its space."""
        entry = self._entries.get(meta.key)
        if entry is None:
            entry = self._entries[meta.key] = BlockEntry(meta=meta)
        self.apply_touches()
        entry.sizes[tier] = nbytes
        if not entry.fastest or self._rank[tier] < self._rank[entry.fastest]:
            entry.fastest = tier
        order = self._orders[tier]
        self.charge(tier, entry.meta.tenant, footprint.nbytes - order.charge(meta.key))
        order.add(meta.key, footprint)
        if self._observer is not None:
            self._observer(entry.meta, tier, True)
        return entry

    def refile(self, tier: str, key: BlockKey, footprint: Footprint | None) -> None:
        """The tier moved a block it holds: file it under its new footprint, keeping its rank."""
        entry = self._entries.get(key)
        if footprint is not None and entry is not None:
            self.apply_touches()
            order = self._orders[tier]
            self.charge(tier, entry.meta.tenant, footprint.nbytes - order.charge(key))
            order.refile(key, footprint)

    def unplace(self, key: BlockKey, tier: str) -> BlockEntry | None:
        """Record that ``tier`` no longer holds the block; forget it when no tier does.

        Returns the entry if the block is still held somewhere, else None.
        """
        self.apply_touches()
        entry = self._entries.get(key)
        order = self._orders[tier]
        if entry is not None:
            self.charge(tier, entry.meta.tenant, -order.charge(key))
        order.remove(key)
        if entry is None:
            return None
        if entry.sizes.pop(tier, None) is not None and self._observer is not None:
            self._observer(entry.meta, tier, False)
        if not entry.sizes:
            del self._entries[key]
            return None
        if entry.fastest == tier:
            entry.fastest = min(entry.sizes, key=self._rank.__getitem__)
        return entry

    def match_prefix(self, keys: Iterable[BlockKey]) -> list[BlockEntry]:
        """Entries of the longest prefix of ``keys`` that is stored (and not being evicted)."""
        # Probed in C (map over dict.get), stopping at the first miss (takewhile over bool: an
        # entry is always true, a miss is None); no Python code runs per block. While an evict
        # runs, also at an entry it took (a default for misses and takewhile over ``live``:
        # 1.6x the time, 130 against 82 us for 2048 blocks).
        if not self._evicting:
            return list(takewhile(bool, map(self._entries.get, keys)))
        return list(takewhile(_LIVE, map(self._entries.get, keys, repeat(_NOT_STORED))))

    def take_for_eviction(self, entry: BlockEntry, pinned_ok: bool = False) -> bool:
        """Mark an unpinned, stored ``entry`` as being evicted (``BlockEntry.live``); False,
        with nothing marked, if it is pinned, already taken or no longer stored.

        ``pinned_ok``: take it even while pinned (an invalidation: no new reader may see it;
        those holding it finish, and it is deleted once they let go)."""
        if (entry.pins and not pinned_ok) or not entry.live \
                or self._entries.get(entry.meta.key) is not entry:
            return False
        entry.live = False
        self._evicting += 1
        return True

    def end_eviction(self, entry: BlockEntry) -> bool:
        """The eviction of a taken ``entry`` ended; True if the block is gone from every tier
        (else it is live again: a delete that failed keeps what was not deleted)."""
        self._evicting -= 1
        gone = self._entries.get(entry.meta.key) is not entry
        entry.live = not gone
        return gone

    def tokens_per_tier(self, entries: Sequence[BlockEntry], block_tokens: int
                        ) -> dict[str, int]:
        """Tokens of ``entries`` by the fastest tier holding each, in chain order (counted in
        C over each entry's ``fastest``: no Python code runs per block)."""
        fastest = list(map(_FASTEST, entries))
        counts = {}
        for name in self._rank:  # a C pass per tier (list.count: the names are one object each)
            if count := fastest.count(name):
                counts[name] = count * block_tokens
        return counts

    def touch(self, entries: list[BlockEntry], hit: bool = True,
              keys: Sequence[BlockKey] | None = None) -> None:
        """A prefix chain was used: bump counters and eviction order, parents last (both on
        the loop's next turn, see the module doc).

        ``keys``, when the caller has them, are the entries' keys in the same order.
        """
        if not entries:
            return
        if keys is None:
            keys = [e.meta.key for e in entries]
        group = entries[0].meta.namespace
        # A long chain reaches the orders in pieces, its tail first, one piece a loop turn, so
        # a 262,144-block lookup does not hold the loop while every order re-ranks it (LRU
        # ranks the pieces exactly as one chain; ARC and the value order judge each piece as
        # a chain of its own).
        # Each piece is cut out when it is applied: cutting all of them here copied every
        # entry and key once more, 4 ms of this turn at 262,144 blocks.
        step = TOUCH_SLICE_BLOCKS
        for start in reversed(range(0, len(entries), step)):
            self._touches.append((keys, entries, start, min(start + step, len(entries)),
                                  group, hit))
        if self._applying:
            return  # already scheduled
        try:
            asyncio.get_running_loop().call_soon(self._apply_some)
            self._applying = True
        except RuntimeError:  # no loop (a tool, a test): now
            self.apply_touches()

    def _apply_some(self) -> None:
        """Apply the oldest touches not applied yet, about a piece's worth of blocks; the rest
        on the next turn."""
        self._applying = False
        budget = TOUCH_SLICE_BLOCKS
        while self._touches and budget > 0:
            touch = self._touches.pop(0)
            self._apply(touch)
            budget -= touch[3] - touch[2]
        if self._touches:
            asyncio.get_running_loop().call_soon(self._apply_some)
            self._applying = True

    def apply_touches(self) -> None:
        """Apply the touches not applied yet to every order and hit counter, in the order they
        were made."""
        while self._touches:
            touches, self._touches = self._touches, []
            for touch in touches:
                self._apply(touch)

    def _apply(self, touch: _Touch) -> None:
        keys, entries, start, stop, group, hit = touch
        if hit:
            for entry in entries[start:stop]:
                entry.hits += 1
        piece = keys[start:stop]
        for order in self._orders.values():
            order.touch_chain(piece, group)

    def pin(self, entries: Iterable[BlockEntry]) -> None:
        for entry in entries:
            entry.pins += 1

    def unpin(self, entries: Iterable[BlockEntry]) -> None:
        for entry in entries:
            entry.pins = max(0, entry.pins - 1)

    def charge(self, tier: str, tenant: str, nbytes: int) -> None:
        """Add ``nbytes`` (negative: give back) to what ``tenant`` is charged in ``tier``."""
        usage = self._usage[tier]
        usage[tenant] = usage.get(tenant, 0) + nbytes
        if usage[tenant] <= 0:
            del usage[tenant]

    def usage(self, tier: str, tenant: str) -> int:
        """Bytes ``tenant`` is charged in ``tier``."""
        return self._usage[tier].get(tenant, 0)

    def owner(self, key: BlockKey) -> str | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.meta.tenant

    def is_protected(self, key: BlockKey) -> bool:
        """Whether ``key`` must not be evicted now (pinned, or already gone)."""
        entry = self._entries.get(key)
        return entry is None or entry.pins > 0

    def victims(self, tier: str, need: RoomNeed,
                is_protected: Callable[[BlockKey], bool] | None = None) -> list[BlockKey] | None:
        """Unprotected blocks of ``tier`` (default: unpinned) whose removal frees ``need``,
        least valuable first, or None when no such set exists (nothing is evicted then)."""
        self.apply_touches()
        return self._orders[tier].evict(need, is_protected or self.is_protected)

    def coldest(self, tier: str, nbytes: int) -> list[BlockKey]:
        """The least valuable unpinned blocks of ``tier`` worth about ``nbytes`` (fewer if the
        tier holds less), for background demotion."""
        self.apply_touches()
        return self._orders[tier].coldest(nbytes, self.is_protected)

    def info(self, entry: BlockEntry, now: float | None = None) -> BlockInfo:
        self.apply_touches()  # its hit counter
        now = time.time() if now is None else now
        return BlockInfo(
            key=entry.meta.key,
            tenant=entry.meta.tenant,
            model_id=entry.meta.model_id,
            tiers=entry.tiers,
            size_bytes=max(entry.sizes.values(), default=0),
            age_s=max(0.0, now - entry.created_s),
            hits=entry.hits,
            block_index=entry.meta.block_index,
            parent=entry.meta.parent,
        )
