"""The block directory: key -> placements, pins, leases and per-block counters.

The directory is the store's single source of truth about which tier holds which block. It is
touched only from the store's event loop, so it needs no locks.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvstore.api import BlockInfo
from kvstore.errors import LeaseNotFound, shown
from kvstore.keys import BlockKey
from kvstore.page import PageMeta
from kvstore.policy.base import EvictionOrder
from kvstore.policy.lru import LruOrder


@dataclass(slots=True)
class BlockEntry:
    """What the store knows about one block."""

    meta: PageMeta
    sizes: dict[str, int] = field(default_factory=dict)  # tier name -> page bytes there
    pins: int = 0  # readers and leases holding it; a pinned block is never evicted
    hits: int = 0
    created_s: float = field(default_factory=time.time)
    last_access_s: float = field(default_factory=time.time)

    @property
    def tiers(self) -> tuple[str, ...]:
        return tuple(self.sizes)


class BlockDirectory:
    """Placements of every block, one eviction order per tier."""

    def __init__(self, tier_names: Iterable[str]) -> None:
        self._entries: dict[BlockKey, BlockEntry] = {}
        self._orders: dict[str, EvictionOrder] = {name: LruOrder() for name in tier_names}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: BlockKey) -> BlockEntry | None:
        return self._entries.get(key)

    def entries(self) -> Iterator[BlockEntry]:
        return iter(list(self._entries.values()))

    def place(self, meta: PageMeta, tier: str, nbytes: int) -> BlockEntry:
        """Record that ``tier`` now holds the block."""
        entry = self._entries.get(meta.key)
        if entry is None:
            entry = self._entries[meta.key] = BlockEntry(meta=meta)
        entry.sizes[tier] = nbytes
        self._orders[tier].add(meta.key)
        return entry

    def unplace(self, key: BlockKey, tier: str) -> BlockEntry | None:
        """Record that ``tier`` no longer holds the block; forget it when no tier does.

        Returns the entry if the block is still held somewhere, else None.
        """
        self._orders[tier].remove(key)
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.sizes.pop(tier, None)
        if not entry.sizes:
            del self._entries[key]
            return None
        return entry

    def match_prefix(self, keys: Iterable[BlockKey]) -> list[BlockEntry]:
        """Entries of the longest prefix of ``keys`` that is stored."""
        matched = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            matched.append(entry)
        return matched

    def touch(self, entries: list[BlockEntry], hit: bool = True) -> None:
        """A prefix chain was used: bump counters and eviction order, parents last."""
        now = time.time()
        for entry in entries:
            entry.last_access_s = now
            entry.hits += hit
        keys = [e.meta.key for e in entries]
        for order in self._orders.values():
            order.touch_chain(keys)

    def pin(self, entries: Iterable[BlockEntry]) -> None:
        for entry in entries:
            entry.pins += 1

    def unpin(self, entries: Iterable[BlockEntry]) -> None:
        for entry in entries:
            entry.pins = max(0, entry.pins - 1)

    def victims(self, tier: str) -> Iterator[BlockKey]:
        """Unpinned keys of ``tier`` from least to most valuable."""

        def evictable(key: BlockKey) -> bool:
            entry = self._entries.get(key)
            return entry is not None and entry.pins == 0 and tier in entry.sizes

        return self._orders[tier].victims(evictable)

    def info(self, entry: BlockEntry, now: float | None = None) -> BlockInfo:
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


@dataclass(slots=True)
class Held:
    """A lease or reservation: pinned entries (or reserved slots) with a deadline."""

    held_id: str
    deadline: float
    entries: list[BlockEntry]
    payload: object = None  # what the holder was given (Lease or Reservation)


class HeldTable:
    """Leases (pinned reads) or reservations (slots being written), expiring at a deadline."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._held: dict[str, Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, entries: list[BlockEntry], lease_s: float, payload: object = None) -> Held:
        held = Held(secrets.token_hex(12), time.time() + lease_s, entries, payload)
        self._held[held.held_id] = held
        return held

    def pop(self, held_id: str) -> Held:
        """Remove and return a holding; one past its deadline but not yet reaped still counts."""
        held = self._held.pop(held_id, None)
        if held is None:
            raise LeaseNotFound(f"{self.kind} {shown(held_id)} does not exist or has expired")
        return held

    def expired(self, now: float | None = None) -> list[Held]:
        """Remove and return everything past its deadline."""
        now = time.time() if now is None else now
        gone = [h for h in self._held.values() if h.deadline < now]
        for held in gone:
            del self._held[held.held_id]
        return gone
