"""Policy contracts: which blocks a tier gives up first, and which blocks a tier admits.

The store asks an ``EvictionOrder`` per tier for victims and an ``AdmissionPolicy`` per tier
whether a demoted block may enter it; neither reaches into tier internals. What a tier needs
freed before a page fits is the tier's own answer (``RoomNeed``, from ``Tier.room_for``), in
the terms an order understands: bytes, and the size class they must come from. Scores come from
recency (LRU, ARC) or from the cost model (seed §8: value = reuse likelihood x time a fetch saves /
bytes, ``ValueOrder``) behind the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

from kvstore.keys import BlockKey
from kvstore.room import Footprint, RoomNeed


class EvictionOrder(ABC):
    """Keeps the keys of one tier ordered from least to most valuable.

    Called only from the store's event loop. ``add``, ``remove`` and ``touch_chain`` are O(1)
    per key; ``coldest`` and ``evict`` walk from the least valuable end and stop as soon as they
    have enough: their cost grows with the victims returned (plus protected keys skipped), never
    with the number of keys held.
    """

    @abstractmethod
    def add(self, key: BlockKey, footprint: Footprint) -> None:
        """A block entered the tier (counts as an access)."""

    @abstractmethod
    def refile(self, key: BlockKey, footprint: Footprint) -> None:
        """The block's footprint changed where it is (no access): it keeps its value."""

    @abstractmethod
    def touch_chain(self, keys: Sequence[BlockKey], group: bytes | None = None) -> None:
        """A prefix chain (parents first) was used: every parent must rank at least as valuable
        as its children, so a chain is evicted from its tail and stays reachable. ``group``
        names the chain's namespace (its fingerprint) for orders that learn per namespace."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """The block left the tier (idempotent)."""

    @abstractmethod
    def charge(self, key: BlockKey) -> int:
        """Bytes ``key`` is charged (0 if absent)."""

    @abstractmethod
    def coldest(self, nbytes: int, is_protected: Callable[[BlockKey], bool],
                size_class: int | None = None) -> list[BlockKey]:
        """The least valuable unprotected keys (of ``size_class``, if given) whose charges add
        up to at least ``nbytes``, or all of them when they add up to less. Changes nothing."""

    @abstractmethod
    def __len__(self) -> int: ...

    def evict(self, need: RoomNeed, is_protected: Callable[[BlockKey], bool]
              ) -> list[BlockKey] | None:
        """Victims that free ``need``, least valuable first, or None when the unprotected keys
        cannot free it (then nothing should be evicted at all). Changes nothing: the caller
        removes the victims."""
        victims = self.coldest(need.nbytes, is_protected, need.size_class)
        if sum(map(self.charge, victims)) < need.nbytes:
            return None
        return victims


class AdmissionPolicy(ABC):
    """Decides whether a block moving down the chain may enter a tier (new blocks and blocks
    that would otherwise be lost bypass it: that is the store's call). Called from the store's
    event loop; every method is fast and does no I/O."""

    @abstractmethod
    def note(self, keys: Iterable[BlockKey]) -> None:
        """The blocks were seen (a put or a lookup hit), in prefix order."""

    @abstractmethod
    def admits(self, key: BlockKey) -> bool:
        """Whether ``key`` may enter the tier now."""

    def admits_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        """``admits`` of each key (a filter may answer them in one pass)."""
        return [self.admits(key) for key in keys]

    def lifts(self, key: BlockKey) -> bool:
        """Whether a put's copy of ``key``, a block only slower tiers hold, may be written into
        this tier (the engine recomputed it rather than fetch it from below). Default: no, a
        put writes only blocks not stored yet."""
        return False
